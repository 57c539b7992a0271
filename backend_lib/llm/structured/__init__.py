"""Structured outputs: request constraints compiled to grammars (xgrammar), per-sequence matcher
state, and the next-token bitmasks the model runner applies to the logits before sampling."""
