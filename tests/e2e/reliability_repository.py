"""The reliability suite's model repository: the three default models plus `llm_small` (the same
checkpoint with a tiny KV pool, few sequences and a short queue, for overload), and the prompt marker
that trips the test-only fault hook."""

from __future__ import annotations

from pathlib import Path

from tooling.repository import DEFAULT_MODELS, REPO_ROOT, ModelSpec, write_model

FAULT_MARKER = "<<inject-fault>>"
"""A prompt holding this fails inside the engine step on the reliability server."""
SMALL_LLM = {
    "max_num_seqs": "4",
    "num_blocks": "12",
    "max_queue_size": "8",
    "max_model_len": "128",
    "max_num_batched_tokens": "256",
}
"""llm_small: 12 blocks of 16 tokens hold fewer than 4 sequences of 128 tokens, so it preempts."""


def write_reliability_repository(repository: Path) -> None:
    for spec in DEFAULT_MODELS:
        if spec.kind != "llm":
            write_model(spec, repository)
            continue
        # The default repository names the checkpoint relative to its own directory.
        parameters = {**spec.parameters, "model": str(REPO_ROOT / "models" / "shakespeare-llama")}
        write_model(ModelSpec("llm", "llm", parameters, max_batch_size=0), repository)
        write_model(
            ModelSpec("llm_small", "llm", {**parameters, **SMALL_LLM}, max_batch_size=0), repository
        )
