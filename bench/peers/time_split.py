"""Where the engine's time goes next to OpenVINO GenAI's (the engine_peers report's side-by-side).

Two measurements at the run's thread count, float32:
- `engine_split` (also `bench.engine --profile`'s, at any precision): one more engine run under
  torch.profiler, its wall time split into GEMMs (the packed oneDNN linears, fbgemm's int8 ones
  and any aten matmul), attention (our paged-attention ops, SDPA), every
  other op, and the rest (Python, scheduling, sampling glue: wall minus the ops' self time);
- `gemm_rates`: GFLOP/s of our packed `Linear` and of OpenVINO's MatMul (compiled by the peer
  worker with the same threads) on the model's weight shapes at decode- and prefill-sized row
  counts, alternated shape by shape so machine noise hits both alike.

`side_by_side` puts them together: the peer's GEMM seconds estimated as ours scaled by the two
rates' ratio over the workload's token mix, and what remains of its measured total for the rest.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

GEMM_OPS = (
    "mkldnn::_linear_pointwise",
    "quantized::linear",  # int8 weights on CPU (fbgemm)
    "llm_cpu::wna16_linear",  # 4/8-bit weights of a pre-quantized checkpoint on CPU
    "aten::addmm",
    "aten::mm",
    "aten::bmm",
    "aten::matmul",
)
KINDS = ("gemm", "attention", "other_ops", "outside_ops")
"""What `engine_split` divides a run's time into; they add up to its `wall`."""
ATTENTION_OPS = ("llm_cpu::paged_attention", "aten::_scaled_dot_product")
ROWS = (16, 64, 512, 2048)
"""Rows of the measured GEMMs: decode batches (16, 64) and prefill chunks (512, 2048 = the token
budget of a step)."""


def weight_shapes(sizes) -> dict[str, tuple[int, int]]:
    """{layer: (in_features, out_features)} of a random Llama of `sizes` (fused qkv, gate_up)."""
    head_dim = sizes.hidden // sizes.heads
    qkv = (sizes.heads + 2 * sizes.kv_heads) * head_dim
    return {
        "qkv_proj": (sizes.hidden, qkv),
        "o_proj": (sizes.heads * head_dim, sizes.hidden),
        "gate_up_proj": (sizes.hidden, 2 * sizes.intermediate),
        "down_proj": (sizes.intermediate, sizes.hidden),
        "lm_head": (sizes.hidden, sizes.vocab),
    }


def engine_split(run: Callable[[], object], timed_seconds: float | None = None) -> dict[str, float]:
    """Seconds of one `run()` by kind: gemm, attention, other_ops (the ops' self time under
    torch.profiler), outside_ops (the rest: Python, scheduling, and the profiler's own cost, ~5%
    here), wall and profiled_wall. Given `timed_seconds` (an unprofiled run's time), the shares
    are scaled to it, so a noisy machine's run-to-run drift does not show up as one kind."""
    from torch.profiler import ProfilerActivity, profile

    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    profiled_wall = time.perf_counter() - started
    split = {"gemm": 0.0, "attention": 0.0, "other_ops": 0.0}
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6
        if event.key.startswith(GEMM_OPS):
            split["gemm"] += seconds
        elif event.key.startswith(ATTENTION_OPS):
            split["attention"] += seconds
        else:
            split["other_ops"] += seconds
    split["outside_ops"] = max(0.0, profiled_wall - sum(split.values()))
    measured = {**split, "profiled_wall": profiled_wall}
    # Scaled even to its own wall: ops timed past it (outside_ops clipped at 0) still add up.
    return scaled_to(measured, profiled_wall if timed_seconds is None else timed_seconds)


def scaled_to(split: dict[str, float], seconds: float) -> dict[str, float]:
    """`split` with its kinds scaled to add up to `seconds` (their shares kept), as `wall`."""
    scale = seconds / sum(split[k] for k in KINDS)
    return {**split, **{k: split[k] * scale for k in KINDS}, "wall": seconds}


def our_gemm_rate(in_features: int, out_features: int, rows: int, seconds: float) -> float:
    """GFLOP/s of our packed Linear on [rows, in] x [out, in]^T, timed for about `seconds`."""
    import torch

    from backend_lib.linear import Linear

    linear = Linear(torch.randn(out_features, in_features) * 0.05, None)
    x = torch.randn(rows, in_features)
    with torch.inference_mode():
        return _rate(lambda: linear(x), 2 * rows * in_features * out_features, seconds)


def _rate(call: Callable[[], object], flops: int, seconds: float) -> float:
    for _ in range(3):
        call()
    calls, started = 0, time.perf_counter()
    while True:
        call()
        calls += 1
        elapsed = time.perf_counter() - started
        if elapsed >= seconds and calls >= 5:
            return flops * calls / elapsed / 1e9


def gemm_rates(worker, shapes: dict[str, tuple[int, int]], rounds: int = 3) -> dict[str, dict]:
    """{"K x N @ M rows": {"ours": GFLOP/s, "openvino": GFLOP/s, "layer": name}} (medians of
    `rounds`, ours and the peer's alternating)."""
    seconds = 0.1
    rates: dict[str, dict] = {}
    for layer, (k, n) in shapes.items():
        for m in ROWS:
            ours, theirs = [], []
            for _ in range(rounds):
                ours.append(our_gemm_rate(k, n, m, seconds))
                answer = worker.call(
                    "matmul",
                    threads=worker.threads,
                    in_features=k,
                    out_features=n,
                    rows=m,
                    seconds=seconds,
                )
                theirs.append(answer["gflops"])
            rates[f"{k}x{n}@{m}"] = {
                "layer": layer,
                "rows": m,
                "flops": 2 * m * k * n,
                "ours": statistics.median(ours),
                "openvino": statistics.median(theirs),
            }
    return rates


def token_mix(prompt_tokens: int, output_tokens: int) -> dict[int, float]:
    """Tokens of a workload per measured row count: output tokens are decoded in small batches
    (half at 16 rows, half at 64), prompt tokens prefilled in chunks (half at 512, half at 2048)."""
    return {
        16: output_tokens / 2,
        64: output_tokens / 2,
        512: prompt_tokens / 2,
        2048: prompt_tokens / 2,
    }


def side_by_side(
    split: dict[str, float], rates: dict[str, dict], mix: dict[int, float], peer_seconds: float
) -> dict:
    """Our split next to the peer's estimate: the peer's GEMM seconds are ours times the ratio of
    the time each would take on the workload's GEMMs (every shape at each row count, weighted by
    the tokens `mix` puts there)."""

    def seconds(system: str) -> float:
        # The lm_head runs on one row per prompt in a prefill: count it at decode sizes only.
        return sum(
            mix[r["rows"]] * r["flops"] / r["rows"] / r[system]
            for r in rates.values()
            if r["layer"] != "lm_head" or r["rows"] < 512
        )

    speed = seconds("ours") / seconds("openvino")  # > 1: the peer's GEMMs are faster
    peer_gemm = split["gemm"] / speed
    return {
        "engine_seconds": split,
        "gemm_speed_openvino_vs_ours": speed,
        "openvino_seconds": {
            "total": peer_seconds,
            "gemm_estimated": peer_gemm,
            "everything_else": max(0.0, peer_seconds - peer_gemm),
        },
    }


def report_lines(result: dict, threads: int) -> list[str]:
    """A paragraph and a table for the report."""
    ours, peer = result["engine_seconds"], result["openvino_seconds"]
    wall = ours["wall"]
    rest = ours["attention"] + ours["other_ops"] + ours["outside_ops"]
    lines = [
        f"Where the time goes at {threads} thread(s), float32: the engine's timed run split "
        "in the shares of one more run under torch.profiler; the peer's "
        "GEMM time estimated from its MatMul rate on the model's shapes (measured alternately "
        "with ours), the rest of its timed run everything else:",
        "",
        "| | engine | OpenVINO GenAI |",
        "|---|---|---|",
        f"| GEMMs | {ours['gemm']:.1f} s | ~{peer['gemm_estimated']:.1f} s (its MatMul "
        f"{result['gemm_speed_openvino_vs_ours']:.2f}x ours) |",
        f"| attention | {ours['attention']:.1f} s | |",
        f"| other ops (norms, rotary, SiLU, copies, sampling) | {ours['other_ops']:.1f} s | |",
        f"| outside ops (Python around them: dispatch, scheduling) | {ours['outside_ops']:.1f} s | |",
        f"| everything but GEMMs | {rest:.1f} s | ~{peer['everything_else']:.1f} s |",
        f"| total | {wall:.1f} s | {peer['total']:.1f} s |",
        "",
    ]
    return lines
