"""Multi-LoRA serving: PEFT adapters (adapter.py), the named list and host cache (registry.py),
a request's adapter (request.py), device slots with LRU replacement (slots.py) and one step's
per-row adapter mapping (batch.py)."""
