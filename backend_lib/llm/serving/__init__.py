"""Bridge between Triton and the engine: request tensors in, the engine loop thread, response tensors
and vLLM-named metrics out."""
