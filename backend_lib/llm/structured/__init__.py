"""Structured outputs: request constraints compiled to grammars (xgrammar, in worker processes:
compile_worker.py), per-sequence matcher state, and the next-token bitmasks the model runner
applies to the logits before sampling."""
