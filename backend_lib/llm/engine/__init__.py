"""The engine: input processing, the step (schedule -> execute -> update) and output processing.

It sits above core/ (scheduling, KV blocks, sequences) and execution/ (the model on the device),
as vLLM v1's engine/ sits above its core; neither of those imports it.
"""
