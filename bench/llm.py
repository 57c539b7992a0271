"""What the LLM-engine benchmarks share: the random-token workload, a fresh engine, greedy
sampling, and the check that compared systems produced the same greedy tokens."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from tooling.checkpoints import Sizes

MIN_TOKEN_AGREEMENT = 0.95
"""In reduced precision, batch shapes change rounding, so a greedy path may part late: required
share of tokens before the first difference (float32 requires identical outputs)."""


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def workload_record(workload: Workload, seed: int) -> dict:
    """How a result JSON describes a greedy, EOS-ignored workload."""
    return {
        "requests": len(workload.prompts),
        "seed": seed,
        "prompt_tokens": sum(map(len, workload.prompts)),
        "output_tokens": workload.num_output_tokens,
        "ignore_eos": True,
        "greedy": True,
    }


def make_workload(sizes: Sizes, seed: int) -> Workload:
    """`sizes.requests` random-token prompts and output lengths of seeded random length."""
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(sizes.requests):
        length = rng.randint(*sizes.prompt_len)
        prompts.append([rng.randrange(3, sizes.vocab) for _ in range(length)])
        output_lens.append(rng.randint(*sizes.output_len))
    return Workload(prompts, output_lens)


def new_engine(model_dir: Path, device, dtype: str, base_dir: Path | None = None, **settings):
    """A fresh LLMEngine (empty prefix cache) with these LLMConfig settings; `base_dir`: what a
    relative draft model path is resolved against."""
    from backend_lib.llm.config import LLMConfig
    from backend_lib.llm.engine.llm_engine import LLMEngine

    config = LLMConfig(model=str(model_dir), dtype=dtype, **settings)
    config.validate()
    return LLMEngine(config, model_dir, device, base_dir=base_dir)


def greedy(max_tokens: int):
    """Greedy sampling of exactly `max_tokens` tokens (EOS ignored)."""
    from backend_lib.llm.core.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def time_to_first_token(output) -> float:
    """Seconds from a request's arrival (its add) to its first token, by the engine's clock."""
    return output.metrics.first_token_time - output.metrics.arrival_time


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Share of requests with identical outputs, and of tokens before the first difference."""
    same_requests = sum(x == y for x, y in zip(a, b, strict=True))
    prefix = sum(_common_prefix(x, y) for x, y in zip(a, b, strict=True))
    return {"requests": same_requests / len(a), "tokens": prefix / sum(len(x) for x in a)}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def check_same(
    reference_name: str, reference: list[list[int]], others: dict[str, list[list[int]]], dtype: str
) -> dict[str, object]:
    """Compare greedy token ids with the reference; SystemExit when they differ (float32) or agree
    on too few tokens (reduced precision). Returns the record for the result JSON."""
    scores = {name: agreement(reference, outputs) for name, outputs in others.items()}
    exact = dtype == "float32"
    for name, score in scores.items():
        if (score["requests"] < 1.0) if exact else (score["tokens"] < MIN_TOKEN_AGREEMENT):
            raise SystemExit(f"{name}: greedy outputs differ from {reference_name} ({score})")
    return {
        "reference": reference_name,
        "exact_required": exact,
        "agreement": scores,
        "passed": True,
    }


def load_hf_model(model_dir: Path, device, dtype: str):
    """The checkpoint in transformers (SDPA attention), on `device`, for inference."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa", local_files_only=True
    )
    return model.to(device).eval()
