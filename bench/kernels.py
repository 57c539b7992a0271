"""Benchmark the Triton kernels against the device's measured peaks.

For each kernel: check the Triton output against the PyTorch reference, then time both (median of
triton.testing.do_bench) and report achieved bandwidth (memory-bound kernels) or FLOP rate
(prefill attention) as a fraction of the measured peak (a large device-to-device copy; a large
matmul). Shapes follow Llama-3-8B (32 query heads, 8 kv heads, head_dim 128, hidden 4096).

    python -m bench.kernels [--out bench/results/kernels.json]    # on a GPU
    python -m bench.kernels --tiny --out /tmp/kernels.json        # CPU smoke run (interpreter)

--tiny (or --quick) runs tiny shapes, on CPU through Triton's interpreter: it proves the benchmark
works; its timings are meaningless.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench import cli
from bench.skeleton import Benchmark

NAME = "kernels"
HEADING = "Triton kernels vs PyTorch"
# threads: the CPU interpreter's, at most 2; repeats: wall-clock calls per kernel on CPU.
DEFAULTS = cli.Defaults("auto", threads=2, repeats=3)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclass
class Shapes:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    block_size: int
    tokens: int  # rows of the elementwise kernels (a prefill step)
    decode_batch: int
    decode_context: int
    long_decode_batch: int
    long_decode_context: int
    prefill_len: int  # one chunk of this many tokens after an equal cached prefix


FULL = Shapes(32, 8, 128, 4096, 14336, 16, 4096, 64, 2048, 4, 32768, 2048)
TINY = Shapes(4, 2, 64, 128, 192, 8, 8, 3, 40, 1, 200, 12)


@dataclass
class BenchCase:
    name: str
    shape: dict
    run_triton: Callable[[], object]
    run_torch: Callable[[], object]
    bytes_moved: int = 0  # minimum HBM traffic, for GB/s
    flops: int = 0  # for FLOP/s (compute-bound kernels)


@dataclass
class Result:
    name: str
    shape: dict
    rel_error: float | None
    """None: infinite (a NaN in the output)."""
    correct: bool
    triton_ms: float | None = None
    torch_ms: float | None = None
    achieved: dict = field(default_factory=dict)


def _bench_ms(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """Median milliseconds per call: do_bench on CUDA; on CPU (interpreter) a plain wall clock
    over `repeats` calls."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, return_mode="median"))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure_peaks(device: torch.device, dtype: torch.dtype, tiny: bool) -> dict:
    """Achievable peaks on this device: copy bandwidth (read + write) and dense matmul rate."""
    n_bytes = (8 if tiny else 2048) * 2**20
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = _bench_ms(lambda: dst.copy_(src), device)
    n = 256 if tiny else 8192
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    matmul_ms = _bench_ms(lambda: a @ b, device)
    return {
        "copy_gbps": 2 * n_bytes / copy_ms / 1e6,
        "matmul_tflops": 2 * n**3 / matmul_ms / 1e9,
        "copy_bytes": n_bytes,
        "matmul_n": n,
    }


def _relative_error(got, want) -> float:
    if isinstance(got, tuple):
        return max(_relative_error(g, w) for g, w in zip(got, want, strict=True))
    diff = (got.double() - want.double()).abs()
    if diff.isnan().any():
        return float("inf")
    return (diff.max() / want.double().abs().max().clamp_min(1e-30)).item()


def _paged_batch(shapes: Shapes, query_lens: list[int], context_lens: list[int], dtype, device):
    """Attention inputs: contexts scattered over a shuffled block pool, already in the cache."""
    bs = shapes.block_size
    blocks_per_seq = [math.ceil(n / bs) for n in context_lens]
    num_blocks = sum(blocks_per_seq)
    cache_shape = (num_blocks, bs, shapes.num_kv_heads, shapes.head_dim)
    k_cache = torch.randn(cache_shape, device=device).to(dtype)
    v_cache = torch.randn(cache_shape, device=device).to(dtype)
    pool = torch.randperm(num_blocks, device=device).to(torch.int32)
    block_tables = torch.zeros(
        (len(context_lens), max(blocks_per_seq)), dtype=torch.int32, device=device
    )
    used = 0
    for b, n_blocks in enumerate(blocks_per_seq):
        block_tables[b, :n_blocks] = pool[used : used + n_blocks]
        used += n_blocks
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], shapes.num_heads, shapes.head_dim, device=device).to(dtype)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
    seq_lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    scale = shapes.head_dim**-0.5
    return (q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale)


def attention_cases(shapes: Shapes, dtype, device) -> list[BenchCase]:
    from kernels.paged_attention import paged_attention_torch, paged_attention_triton

    elt = torch.finfo(dtype).bits // 8
    cases = []
    for name, batch, context in (
        ("paged_attention_decode", shapes.decode_batch, shapes.decode_context),
        ("paged_attention_long_decode", shapes.long_decode_batch, shapes.long_decode_context),
    ):
        args = _paged_batch(shapes, [1] * batch, [context] * batch, dtype, device)
        kv_bytes = 2 * batch * context * shapes.num_kv_heads * shapes.head_dim * elt
        q_bytes = 2 * batch * shapes.num_heads * shapes.head_dim * elt  # q in, out
        cases.append(
            BenchCase(
                name,
                {"batch": batch, "context": context},
                lambda args=args: paged_attention_triton(*args),
                lambda args=args: paged_attention_torch(*args),
                bytes_moved=kv_bytes + q_bytes,
            )
        )

    # One chunk after an equal cached prefix: query i attends prefix + i + 1 keys.
    chunk = shapes.prefill_len
    args = _paged_batch(shapes, [chunk], [2 * chunk], dtype, device)
    visible_pairs = sum(chunk + i + 1 for i in range(chunk))
    cases.append(
        BenchCase(
            "paged_attention_prefill_chunk",
            {"chunk": chunk, "cached_prefix": chunk},
            lambda: paged_attention_triton(*args),
            lambda: paged_attention_torch(*args),
            flops=4 * visible_pairs * shapes.num_heads * shapes.head_dim,  # QK^T and PV
        )
    )
    return cases


def elementwise_cases(shapes: Shapes, dtype, device) -> list[BenchCase]:
    from kernels.activation import silu_and_mul_torch, silu_and_mul_triton
    from kernels.kv_cache import write_kv_cache_torch, write_kv_cache_triton
    from kernels.rmsnorm import rms_norm_torch, rms_norm_triton
    from kernels.rotary import apply_rotary_torch, apply_rotary_triton, rope_cos_sin_cache

    elt = torch.finfo(dtype).bits // 8
    t, hidden, d = shapes.tokens, shapes.hidden, shapes.head_dim
    hq, hkv = shapes.num_heads, shapes.num_kv_heads
    cases = []

    x = torch.randn(t, hidden, device=device).to(dtype)
    residual = torch.randn(t, hidden, device=device).to(dtype)
    weight = torch.randn(hidden, device=device).to(dtype)
    cases.append(
        BenchCase(
            "rms_norm_residual",
            {"tokens": t, "hidden": hidden},
            lambda: rms_norm_triton(x, weight, 1e-6, residual),
            lambda: rms_norm_torch(x, weight, 1e-6, residual),
            bytes_moved=4 * t * hidden * elt,  # x, residual in; out, sum out
        )
    )

    cache = rope_cos_sin_cache(d, 8192, 500000.0, None, torch.float32, device)
    positions = torch.randint(0, 8192, (t,), device=device)
    q = torch.randn(t, hq, d, device=device).to(dtype)
    k = torch.randn(t, hkv, d, device=device).to(dtype)
    cases.append(
        BenchCase(
            "apply_rotary",
            {"tokens": t, "num_heads": hq, "num_kv_heads": hkv, "head_dim": d},
            lambda: apply_rotary_triton(positions, q, k, cache),
            lambda: apply_rotary_torch(positions, q, k, cache),
            bytes_moved=2 * t * (hq + hkv) * d * elt + t * d * 4,
        )
    )

    gate_up = torch.randn(t, 2 * shapes.intermediate, device=device).to(dtype)
    cases.append(
        BenchCase(
            "silu_and_mul",
            {"tokens": t, "intermediate": shapes.intermediate},
            lambda: silu_and_mul_triton(gate_up),
            lambda: silu_and_mul_torch(gate_up),
            bytes_moved=3 * t * shapes.intermediate * elt,
        )
    )

    num_blocks = math.ceil(t / shapes.block_size) * 2
    slots = torch.randperm(num_blocks * shapes.block_size, device=device)[:t]
    key = torch.randn(t, hkv, d, device=device).to(dtype)
    value = torch.randn(t, hkv, d, device=device).to(dtype)
    caches = {
        name: torch.zeros(2, num_blocks, shapes.block_size, hkv, d, device=device, dtype=dtype)
        for name in ("triton", "torch")
    }

    def write(fn, kv):
        fn(key, value, kv[0], kv[1], slots)
        return kv

    cases.append(
        BenchCase(
            "write_kv_cache",
            {"tokens": t, "num_kv_heads": hkv, "head_dim": d},
            lambda: write(write_kv_cache_triton, caches["triton"]),
            lambda: write(write_kv_cache_torch, caches["torch"]),
            bytes_moved=4 * t * hkv * d * elt + t * 8,
        )
    )
    return cases


def run_case(case: BenchCase, dtype, device, peaks: dict, repeats: int) -> Result:
    got, want = case.run_triton(), case.run_torch()
    err = _relative_error(got, want)
    # A NaN in the output is an infinite error: recorded as null (JSON has no Infinity).
    result = Result(
        case.name, case.shape, err if math.isfinite(err) else None, err <= TOLERANCE[dtype]
    )
    if not result.correct:
        return result  # timings of a wrong kernel mean nothing
    result.triton_ms = _bench_ms(case.run_triton, device, repeats)
    result.torch_ms = _bench_ms(case.run_torch, device, repeats)
    seconds = result.triton_ms / 1e3
    if case.bytes_moved:
        gbps = case.bytes_moved / seconds / 1e9
        result.achieved = {"gbps": gbps, "fraction_of_copy_peak": gbps / peaks["copy_gbps"]}
    if case.flops:
        tflops = case.flops / seconds / 1e12
        result.achieved = {
            "tflops": tflops,
            "fraction_of_matmul_peak": tflops / peaks["matmul_tflops"],
        }
    return result


def run(args: argparse.Namespace, _scratch: Path) -> dict:
    from backend_lib.device import resolve_dtype

    device = cli.default_device(args.device)
    if device.type == "cpu":
        if not args.quick:
            raise SystemExit(
                "no CUDA device: only --tiny runs on CPU (through Triton's interpreter)"
            )
        # Must precede the first import of the kernel modules (@triton.jit reads it).
        os.environ["TRITON_INTERPRET"] = "1"
        if args.threads:
            torch.set_num_threads(min(args.threads, torch.get_num_threads()))
    dtype = resolve_dtype(args.dtype, device)
    if device.type == "cpu" and dtype == torch.bfloat16:
        raise SystemExit(
            "bfloat16 is not supported by Triton's CPU interpreter; use float32 or float16"
        )
    torch.manual_seed(args.seed)

    shapes = TINY if args.quick else FULL
    peaks = measure_peaks(device, dtype, args.quick)
    cases = attention_cases(shapes, dtype, device) + elementwise_cases(shapes, dtype, device)
    results = [run_case(case, dtype, device, peaks, args.repeats) for case in cases]
    return {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else "cpu (interpreter)",
        "dtype": str(dtype).removeprefix("torch."),
        "mode": "tiny" if args.quick else "full",
        "note": "tiny shapes on CPU through Triton's interpreter: timings are meaningless"
        if device.type == "cpu"
        else "medians of triton.testing.do_bench",
        "shapes": asdict(shapes),
        "peaks": peaks,
        "kernels": [asdict(r) for r in results],
    }


def report(result: dict) -> list[str]:
    """One line on the device's peaks, one per kernel."""
    peaks = result["peaks"]
    lines = [
        f"{result['device']}, {result['dtype']}: copy {peaks['copy_gbps']:.1f} GB/s, "
        f"matmul {peaks['matmul_tflops']:.2f} TFLOP/s ({result['note']})",
        "",
    ]
    for r in result["kernels"]:
        status = "ok " if r["correct"] else "BAD"
        timing = (
            ""
            if r["triton_ms"] is None
            else f"triton {r['triton_ms']:9.3f} ms  torch {r['torch_ms']:9.3f} ms  "
        )
        rate = "  ".join(f"{k} {v:.3g}" for k, v in r["achieved"].items())
        error = "inf" if r["rel_error"] is None else f"{r['rel_error']:.1e}"
        lines.append(f"    {status} {r['name']:32s} err {error}  {timing}{rate}")
    return lines


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tiny",
        dest="quick",
        action="store_true",
        help="tiny shapes; CPU via Triton's interpreter",
    )


# No plot: one line per kernel, the report reads better.
BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, add_args=add_args)


def main(argv: list[str] | None = None) -> dict:
    """The benchmark's run; exits 1 (its result written) when a kernel is not correct."""
    result = BENCHMARK.main(argv)
    if not all(r["correct"] for r in result["kernels"]):
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
