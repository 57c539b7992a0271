"""The engine's device-independent core: requests and sequences, the scheduler over the paged KV
cache (block pool, KV-cache manager), detokenization, outputs and statistics."""
