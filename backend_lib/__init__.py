"""Shared engine behind the Triton Python-backend models (llm, embedding, rerank)."""
