"""Helpers shared by the LLM-engine benchmarks (batching_spread, prefix_cache, kv_memory, preemption):
common options, torch set-up, a random checkpoint, a fresh engine, output checks, target lines."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import Sizes, agreement, build_checkpoint  # noqa: E402

MIN_TOKEN_AGREEMENT = 0.95
"""In reduced precision, batch shapes change rounding, so a greedy path may part late: required
share of tokens before the first difference (float32 requires identical outputs)."""


def add_common_args(parser: argparse.ArgumentParser, name: str, repeats: int) -> None:
    """The options every benchmark takes (bench_contract)."""
    parser.add_argument("--quick", action="store_true", help="tiny sizes (< 40 s), for tests")
    parser.add_argument("--out", type=Path, default=Path(f"bench/results/{name}.json"))
    parser.add_argument("--device", default=None, help="cpu, cuda (default: CUDA if available)")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="default: float32 on CPU, bfloat16 on CUDA",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (0: torch default)"
    )
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--seed", type=int, default=0)


def setup_torch(args: argparse.Namespace):
    """Apply --threads; returns (torch.device, dtype name)."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return device, args.dtype or ("bfloat16" if device.type == "cuda" else "float32")


def build_model(sizes: Sizes, out_dir: Path, seed: int, max_positions: int = 1024) -> int:
    """bench_engine's random Llama checkpoint, admitting `max_positions` tokens (rotary positions
    have no weights, so a larger limit changes nothing else); returns the parameter count."""
    num_params = build_checkpoint(sizes, out_dir, seed)
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = max_positions
    config_path.write_text(json.dumps(config, indent=2))
    return num_params


def new_engine(model_dir: Path, device, dtype: str, **settings):
    """A fresh LLMEngine (empty prefix cache) with these LLMConfig settings."""
    from backend_lib.llm.config import LLMConfig
    from backend_lib.llm.core.engine import LLMEngine

    config = LLMConfig(model=str(model_dir), dtype=dtype, **settings)
    config.validate()
    return LLMEngine(config, model_dir, device)


def greedy(max_tokens: int):
    from backend_lib.llm.core.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def time_to_first_token(output) -> float:
    """Seconds from a request's arrival (its add) to its first token, by the engine's clock."""
    return output.metrics.first_token_time - output.metrics.arrival_time


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


def summary_line(name: str, value: float | None, target: str, met: bool | None) -> str:
    shown = "n/a" if value is None else f"{value:.3f}"
    verdict = {True: "met", False: "NOT met", None: "not measured"}[met]
    return f"Target: {name} {target}: measured {shown} — {verdict}."
