"""Encoder models (embedding, rerank) on token-budget micro-batching."""
