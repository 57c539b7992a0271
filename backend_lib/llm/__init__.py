"""Paged-KV LLM engine: block pool, scheduler, model runner, sampler, engine loop."""
