"""Decode GEMV bandwidth (issue 47): how fast each CPU linear path streams its weight at small M,
against a plain read of the same bytes on the same threads.

    python -m bench.gemv_bandwidth [--threads 1 2] [--rows 1 4] [--repeats 5] [--dtypes ...]

prints the JSON of `measure` for each thread count. The layers are built as the engine builds them:

- `float32`, `bfloat16`: backend_lib.linear.Linear (the blocked GEMV up to its gemv_max_rows rows,
  oneDNN's GEMM above); `float32-onednn`, `bfloat16-onednn`: the same layer with the GEMV off (the
  path before it);
- `int8`: backend_lib.quantization.QuantizedLinear (fbgemm, W8A8 dynamic);
- `w4a16`, `w4a8`: WNA16Linear, 4-bit symmetric group-128 weights, bfloat16 activations; w4a8 with
  the op's dynamic int8 activations (C++ kernels built for AVX2, or AVX-512 with VNNI; skipped
  elsewhere).

Method: for each dtype and shape, enough copies of the layer that their weights exceed
`working_set` bytes (default 1 GiB, over 3x this machine's 300 MiB L3), so each call reads its weight
from memory as a decode step does. Each repeat times, back to back, the plain read of every copy's
bytes (`llm_cpu.stream_read`: each byte once, widest loads, split evenly over the threads) and the
layer called once per copy; the bytes are those the layer holds (oneDNN's packed buffer; the WNA16
op's packed words, scales and zero points; fbgemm's int8 values and row scales, read through an int8
tensor of the same size since its packed buffer is not reachable). GB/s = bytes / seconds (1e9
bytes), medians over the repeats; `fraction` = kernel / plain. A dtype's totals weigh its shapes by
bytes, as one decode step reads each projection once per layer.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Mapping

import torch

from bench.output import machine_info

LLAMA_1B_SHAPES = {
    "qkv": (3072, 2048),
    "o": (2048, 2048),
    "gate_up": (16384, 2048),
    "down": (2048, 8192),
    "lm_head": (32000, 2048),
}
"""Llama-3.2-1B's fused projections as the engine runs them: name -> (out N, in K)."""
DTYPES = ("float32", "bfloat16", "int8", "w4a16", "w4a8")
BASELINES = ("float32-onednn", "bfloat16-onednn")
"""The float layers with the GEMV off: oneDNN's GEMM at every M (the path before the GEMV)."""
WORKING_SET = 1 << 30
GROUP_SIZE = 128


@dataclasses.dataclass
class Copies:
    """Copies of one layer: a call per copy (x [M, K] -> y), the tensors whose bytes a plain read
    takes, and the bytes a call streams."""

    calls: list[Callable[[torch.Tensor], torch.Tensor]]
    read: list[torch.Tensor]
    bytes_per_copy: int
    x_dtype: torch.dtype
    in_features: int


def _count(nbytes: int, working_set: int) -> int:
    return max(2, -(-working_set // nbytes))


def _float_copies(n: int, k: int, dtype: str, working_set: int) -> Copies | None:
    from backend_lib.linear import Linear

    dt = torch.bfloat16 if dtype.startswith("bfloat16") else torch.float32
    weight = (torch.randn(n, k) * 0.02).to(dt)
    layers = [Linear(weight.clone(), None)]
    if not layers[0].uses_onednn:  # e.g. bfloat16 on a CPU without native bf16: F.linear
        return None
    nbytes = torch.ops.mkldnn._nbytes(layers[0]._packed)
    layers += [Linear(weight.clone(), None) for _ in range(_count(nbytes, working_set) - 1)]
    if dtype.endswith("-onednn"):
        for layer in layers:
            layer.gemv_max_rows = 0
    read = [torch.ops.llm_cpu.mkldnn_bytes(layer._packed) for layer in layers]
    return Copies(layers, read, nbytes, dt, k)


def _int8_copies(n: int, k: int, working_set: int) -> Copies:
    from backend_lib.quantization import QuantizedLinear, quantize_weight

    q, scale = quantize_weight(torch.randn(n, k) * 0.02, "int8")
    nbytes = q.numel() + scale.numel() * 4
    count = _count(nbytes, working_set)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layers = [QuantizedLinear(q, scale, None, "int8") for _ in range(count)]
    # Same size as what fbgemm holds (its packed buffer is not reachable from here).
    read = [torch.randint(-127, 128, (nbytes,), dtype=torch.int8) for _ in range(count)]
    return Copies([layer.forward for layer in layers], read, nbytes, torch.float32, k)


def _wna16_copies(n: int, k: int, dtype: str, working_set: int) -> Copies | None:
    from backend_lib.llm.execution.checkpoint_quantization.layers import WNA16Linear
    from kernels.wna16_linear import pack_wna16, wna16_int8_dot

    int8 = dtype == "w4a8"
    if int8 and not wna16_int8_dot():
        return None
    u = torch.randint(0, 16, (n, k))
    scales = torch.rand(n, k // GROUP_SIZE) * 0.01 + 1e-3
    zeros = torch.full((n, k // GROUP_SIZE), 8, dtype=torch.uint8)
    base = WNA16Linear(pack_wna16(u, 4), scales, zeros, GROUP_SIZE, 4, None, dynamic_int8=int8)
    if base._prepared is None:
        return None
    prepared = base._prepared
    held = (prepared.packed, prepared.scales, prepared.zeros)
    nbytes = sum(t.numel() * t.element_size() for t in held)
    layers = [base]
    for _ in range(_count(nbytes, working_set) - 1):
        layer = copy.copy(base)  # a module sharing nothing it computes with: its own prepared copy
        layer._prepared = dataclasses.replace(
            prepared, **{f: getattr(prepared, f).clone() for f in ("packed", "scales", "zeros")}
        )
        layers.append(layer)
    read = [t for layer in layers for t in (layer._prepared.packed, layer._prepared.scales)]
    read += [z for layer in layers if (z := layer._prepared.zeros).dim()]  # symmetric: none
    return Copies([layer.call_2d() for layer in layers], read, nbytes, torch.bfloat16, k)


def _copies(n: int, k: int, dtype: str, working_set: int) -> Copies | None:
    if dtype in ("float32", "bfloat16", *BASELINES):
        return _float_copies(n, k, dtype, working_set)
    if dtype == "int8":
        return _int8_copies(n, k, working_set)
    if dtype in ("w4a16", "w4a8"):
        return _wna16_copies(n, k, dtype, working_set)
    raise ValueError(f"unknown dtype {dtype!r}: expected one of {DTYPES + BASELINES}")


def _time_pair(copies: Copies, rows: int, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of the plain read and of the calls over all copies, `repeats` times interleaved."""
    x = torch.randn(rows, copies.in_features).to(copies.x_dtype)
    for call in copies.calls[:2]:  # first-call costs (oneDNN's primitive cache) out of the timing
        call(x)
    plain, kernel = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        torch.ops.llm_cpu.stream_read(copies.read)
        plain.append(time.perf_counter() - started)
        started = time.perf_counter()
        for call in copies.calls:
            call(x)
        kernel.append(time.perf_counter() - started)
    return plain, kernel


def plain_read_gb_per_s(threads: int, nbytes: int = WORKING_SET, repeats: int = 5) -> float:
    """What a plain read streams on `threads` torch threads (restored after), GB/s: the median over
    `repeats` of `llm_cpu.stream_read` over `nbytes` of filled memory (16 buffers, past the L3),
    the reference `measure` takes for its fractions. Without the C++ library, torch's float32 sum
    over the same bytes (measured ~15% slower on one thread)."""
    from kernels import cpu_extension

    buffers = [torch.randn(nbytes // 16 // 4) for _ in range(16)]
    library = cpu_extension.load()

    def read() -> None:
        if library:
            torch.ops.llm_cpu.stream_read(buffers)
        else:
            for buffer in buffers:
                buffer.sum()

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        read()
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            read()
            seconds.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous)
    return sum(b.numel() * 4 for b in buffers) / statistics.median(seconds) / 1e9


def _entry(total_bytes: int, plain: list[float], kernel: list[float]) -> dict:
    plain_gbps = total_bytes / statistics.median(plain) / 1e9
    kernel_gbps = total_bytes / statistics.median(kernel) / 1e9
    return {
        "plain_gbps": plain_gbps,
        "kernel_gbps": kernel_gbps,
        "fraction": kernel_gbps / plain_gbps,
        # Per-repeat ratios: how much the interleaved pairs move on a shared machine.
        "fraction_spread": sorted(p / q for p, q in zip(plain, kernel, strict=True)),
    }


def measure(
    threads: int,
    shapes: Mapping[str, tuple[int, int]] = LLAMA_1B_SHAPES,
    dtypes: Iterable[str] = DTYPES,
    repeats: int = 5,
    *,
    rows: Iterable[int] = (1,),
    working_set: int = WORKING_SET,
) -> dict:
    """Plain-read and kernel GB/s and their fraction per dtype (totals over `shapes`, weighted by
    bytes) and per shape and row count M, on `threads` torch threads (restored after). `shapes`:
    name -> (out N, in K); `dtypes`: names of DTYPES or BASELINES (a dtype this machine cannot run
    is reported as skipped). Needs the C++ library (`make setup`)."""
    from kernels import cpu_extension

    if not cpu_extension.load():
        raise RuntimeError(f"the C++ CPU kernels are needed: {cpu_extension.check_build()}")
    rows = tuple(rows)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        result = {"threads": threads, "rows": list(rows), "working_set": working_set}
        result["dtypes"] = {
            dtype: _measure_dtype(dtype, shapes, rows, repeats, working_set) for dtype in dtypes
        }
    finally:
        torch.set_num_threads(previous)
    return result


def _measure_dtype(
    dtype: str,
    shapes: Mapping[str, tuple[int, int]],
    rows: Iterable[int],
    repeats: int,
    working_set: int,
) -> dict:
    """One dtype of `measure`: per shape and M, then totals per M (the first M's at the top)."""
    per_shape: dict[str, dict] = {}
    # M -> [bytes, plain seconds per repeat, kernel seconds per repeat], summed over the shapes.
    sums = {m: [0, [0.0] * repeats, [0.0] * repeats] for m in rows}
    for name, (n, k) in shapes.items():
        copies = _copies(n, k, dtype, working_set)
        if copies is None:
            return {"skipped": "not supported here (oneDNN packing; the 4-bit C++ op; w4a8: VNNI)"}
        total = copies.bytes_per_copy * len(copies.calls)
        per_shape[name] = {"bytes_per_call": copies.bytes_per_copy, "copies": len(copies.calls)}
        for m in rows:
            plain, kernel = _time_pair(copies, m, repeats)
            per_shape[name][f"M={m}"] = _entry(total, plain, kernel)
            sums[m][0] += total
            sums[m][1] = [a + b for a, b in zip(sums[m][1], plain, strict=True)]
            sums[m][2] = [a + b for a, b in zip(sums[m][2], kernel, strict=True)]
        del copies  # before the next shape's copies: one working set at a time
    totals = {f"M={m}": _entry(*sums[m]) for m in rows}
    return {**next(iter(totals.values())), "by_rows": totals, "shapes": per_shape}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES + BASELINES)
    parser.add_argument(
        "--shapes", nargs="+", default=list(LLAMA_1B_SHAPES), choices=list(LLAMA_1B_SHAPES)
    )
    parser.add_argument(
        "--working-set", type=int, default=WORKING_SET, help="bytes of weights cycled through"
    )
    args = parser.parse_args(argv)
    shapes = {name: LLAMA_1B_SHAPES[name] for name in args.shapes}
    results = [
        measure(t, shapes, args.dtypes, args.repeats, rows=args.rows, working_set=args.working_set)
        for t in args.threads
    ]
    print(json.dumps({"machine": machine_info(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
