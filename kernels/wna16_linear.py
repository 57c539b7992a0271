"""Weight-only integer linear ("WNA16": 4- or 8-bit weights, 16/32-bit activations) for
pre-quantized checkpoints (compressed-tensors' pack-quantized layout; GPTQ/AWQ once converted).

Contract, for an out x in = N x K linear:

- `qweight` int32 [N, K * bits // 32]: element k of row n is the unsigned value u in [0, 2^bits)
  in bits [(k * bits) % 32, +bits) of word (k * bits) // 32 of row n (for bits=4, element k is
  nibble k % 8 of word k // 8).
- `scales` float32 [N, K // group_size]; `zeros` uint8 [N, K // group_size], in u's unsigned
  domain (a symmetric checkpoint gives 2^(bits - 1)); optional `mins` float32 [N, K // group_size]
  (GGUF's Q4_1 and K-quants: llama.cpp's `d * q - dmin_m`, Q4_1's `d * q + m` as mins = -m).
- w[n, k] = (u[n, k] - zeros[n, g]) * scales[n, g] (- mins[n, g] where given), g = k // group_size,
  in float32: the product rounded, then the difference (with zeros 0, numpy's `s * u - m` bit for
  bit, as gguf-py dequantizes). Without mins nothing is subtracted.
- bits in {4, 8} (GGUF's 5- and 6-bit values come in 8-bit containers); group_size divides K, and
  K and group_size are multiples of 32 // bits (per-channel: group_size = K).

`wna16_linear_*(x, qweight, scales, zeros, group_size, bits, bias=None, *, mins=None)` returns
`x @ w.T + bias` for x [M, K], in x's dtype: products accumulated in float32, rounded once to x's
dtype. Activations are not quantized, except on the CPU op's dynamic int8 path below.

Dynamic int8 activations (`dynamic_int8=True`, 4-bit weights, float32 or bfloat16 x, the C++
kernels built for AVX2, or for AVX-512 on a CPU with AVX512-VNNI: `wna16_int8_dot()`; twin
`wna16_linear_int8_torch`): each row of x is quantized at the call per
chunk of K (the group, or for groups over 256 inputs the largest divisor of it within 256 that is a
multiple of 8: `int8_chunk`), symmetric, xq = round-half-even(x * (127 / max|x|)) with scale
max|x| / 127 (0 for an all-zero chunk), as OpenVINO's CPU plugin quantizes activations for
compressed weights by default. Then y = sum over chunks of scale_w * scale_x * (xq . (u - z))
(- min_w * scale_x * sum(xq) with mins), the dot products exact in int32, + bias, rounded once to
x's dtype.

PyTorch twin (`wna16_linear_torch`): dequantize in float32, float32 matmul, bias, cast; the
reference, and the fallback wherever no kernel applies.
Triton kernel (`wna16_linear_triton`): one program per [BLOCK_M, BLOCK_N] output tile; each K
step gathers the packed words of its [BLOCK_K, BLOCK_N] weight tile, unpacks and dequantizes them
in registers (float32), converts to x's dtype and `tl.dot`s into a float32 accumulator.
CPU fast path (`prepare_wna16_cpu` once at load, then `wna16_linear_cpu` per call, only where
`wna16_cpu_takes(x)`): torch.ops.llm_cpu.wna16_linear (kernels/csrc/wna16_linear_cpu.cpp), which
unpacks and FMAs straight from the packed words (bfloat16 pairs through AVX512-BF16's dot product
where it can), or dequantizes blocks of the weight for a GEMM from a row count that depends on the
ISA (with AVX-512 the direct kernel measured as fast at every M, so only AVX2 and baseline builds
switch). The op takes no mins: `prepare_wna16_cpu` folds them into float zero points,
z' = z + m / s, so its results with mins (its dequantize-for-GEMM path included) are within rounding
of the twin's, not bit-identical; a group with s == 0 and m != 0 (the constant -m) is stored as
u = 0, z' = 1, s' = m; only non-finite minimums cannot fold (`cpu_folds_mins`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import cpu_extension

BITS = (4, 8)

_CPU_TILE = 16
"""Output rows per tile of the CPU layout (kTile in kernels/csrc/wna16_linear_cpu.cpp)."""
_NIBBLE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""The k offset (within its word) of nibble j of a CPU-layout 4-bit word (slot_k in the C++)."""


def _check_layout(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bits: int,
    *,
    mins: torch.Tensor | None = None,
) -> tuple[int, int]:
    """(N, K) of a valid weight; ValueError naming the first bad argument otherwise."""
    if bits not in BITS:
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(
            f"qweight must be int32 [N, K * bits // 32], got {qweight.dtype} {tuple(qweight.shape)}"
        )
    n, k = qweight.shape[0], qweight.shape[1] * 32 // bits
    if (
        not isinstance(group_size, int)
        or group_size <= 0
        or k % group_size
        or group_size % (32 // bits)
    ):
        raise ValueError(
            f"group_size must divide K = {k} and be a multiple of {32 // bits} (32 // bits), got {group_size!r}"
        )
    groups = k // group_size
    if scales.shape != (n, groups) or not scales.is_floating_point():
        raise ValueError(
            f"scales must be float [N, K // group_size] = [{n}, {groups}], got {scales.dtype} {tuple(scales.shape)}"
        )
    if zeros.shape != (n, groups) or zeros.is_floating_point() or zeros.is_complex():
        raise ValueError(
            f"zeros must be uint8 [N, K // group_size] = [{n}, {groups}], got {zeros.dtype} {tuple(zeros.shape)}"
        )
    if mins is not None and (
        not isinstance(mins, torch.Tensor)
        or mins.shape != (n, groups)
        or mins.dtype != torch.float32
    ):
        got = f"{mins.dtype} {tuple(mins.shape)}" if isinstance(mins, torch.Tensor) else type(mins)
        raise ValueError(
            f"mins must be float32 [N, K // group_size] = [{n}, {groups}] or None, got {got}"
        )
    return n, k


def _check_x(x: torch.Tensor, k: int, bias: torch.Tensor | None, n: int) -> None:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, K] with K = {k}, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a float tensor, got {x.dtype}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [N] = [{n}], got {tuple(bias.shape)}")


def pack_wna16(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values u (integer [N, K], each in [0, 2^bits)) -> qweight int32 [N, K * bits // 32]
    in the contract's layout (element k in bits (k * bits) % 32 of word (k * bits) // 32)."""
    if bits not in BITS:
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    per_word = 32 // bits
    if u.dim() != 2 or u.is_floating_point() or u.shape[1] % per_word:
        raise ValueError(
            f"u must be integer [N, K] with K a multiple of {per_word}, got {u.dtype} {tuple(u.shape)}"
        )
    if u.numel() and (int(u.min()) < 0 or int(u.max()) >= 1 << bits):
        raise ValueError(f"u must hold values in [0, {1 << bits}) for bits={bits}")
    shifts = torch.arange(per_word, device=u.device, dtype=torch.int64) * bits
    words = (u.to(torch.int64).view(u.shape[0], -1, per_word) << shifts).sum(-1)
    # Words >= 2^31 wrap to negative int32, the same 32 bits.
    return (words - ((words >> 31) << 32)).to(torch.int32)


def unpack_wna16(qweight: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """qweight int32 [N, K * bits // 32] -> its unsigned values uint8 [N, K] (`k` = K)."""
    if bits not in BITS:
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    per_word = 32 // bits
    if qweight.dim() != 2 or qweight.dtype != torch.int32 or qweight.shape[1] * per_word != k:
        raise ValueError(
            f"qweight must be int32 [N, k * bits // 32] with k = {k}, got {qweight.dtype} {tuple(qweight.shape)}"
        )
    shifts = torch.arange(per_word, device=qweight.device, dtype=torch.int32) * bits
    # Arithmetic shift of a negative word fills with ones; the mask keeps only the value's bits.
    u = (qweight.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return u.reshape(qweight.shape[0], k).to(torch.uint8)


def dequantize_wna16(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bits: int,
    *,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight w [N, K] float32: (u - zeros[group]) * scales[group] (- mins[group]), as the
    contract reads (each operation rounded to float32 on its own)."""
    n, k = _check_layout(qweight, scales, zeros, group_size, bits, mins=mins)
    u = unpack_wna16(qweight, bits, k).float().view(n, k // group_size, group_size)
    w = (u - zeros.float().unsqueeze(-1)) * scales.float().unsqueeze(-1)
    if mins is not None:
        w = w - mins.unsqueeze(-1)
    return w.view(n, k)


def wna16_linear_torch(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bits: int,
    bias: torch.Tensor | None = None,
    *,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """The contract in plain PyTorch: x [M, K] @ dequantized w.T in float32, + bias, in x's dtype."""
    n, k = _check_layout(qweight, scales, zeros, group_size, bits, mins=mins)
    _check_x(x, k, bias, n)
    y = x.float() @ dequantize_wna16(qweight, scales, zeros, group_size, bits, mins=mins).T
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


# --- Triton ----------------------------------------------------------------------------------------


@triton.jit
def _wna16_linear_kernel(
    x_ptr,
    qw_ptr,
    scale_ptr,
    zero_ptr,
    min_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_x,
    stride_qw,
    stride_sz,
    stride_out,
    group_size,
    BITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_MINS: tl.constexpr = False,
):
    PER_WORD: tl.constexpr = 32 // BITS
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(
            x_ptr + rows64[:, None] * stride_x + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        wmask = col_mask[None, :] & k_mask[:, None]
        # [BLOCK_K, BLOCK_N] (W.T): each packed word is gathered once per value it holds (cached).
        words = tl.load(
            qw_ptr + cols64[None, :] * stride_qw + (ks // PER_WORD)[:, None], mask=wmask, other=0
        )
        # Shift of the int32 word (arithmetic for words >= 2^31), then the mask: u unsigned.
        u = (words >> ((ks % PER_WORD) * BITS)[:, None]) & ((1 << BITS) - 1)
        groups = (ks // group_size)[:, None]
        scale = tl.load(scale_ptr + cols64[None, :] * stride_sz + groups, mask=wmask, other=0.0)
        zero = tl.load(zero_ptr + cols64[None, :] * stride_sz + groups, mask=wmask, other=0)
        w = (u.to(tl.float32) - zero.to(tl.float32)) * scale
        if HAS_MINS:
            w -= tl.load(min_ptr + cols64[None, :] * stride_sz + groups, mask=wmask, other=0.0)
        acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows64[:, None] * stride_out + cols64[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def wna16_linear_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bits: int,
    bias: torch.Tensor | None = None,
    *,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of `wna16_linear_torch` (same contract). The weight is dequantized in
    float32 and rounded to x's dtype before the dot (exact for float32 x; float16/bfloat16 x round
    each weight once, as their GEMMs would). With mins, a GPU compile may fuse the product and the
    difference into one FMA (one rounding instead of two): within rounding of the twin."""
    n, k = _check_layout(qweight, scales, zeros, group_size, bits, mins=mins)
    _check_x(x, k, bias, n)
    x = x if x.stride(1) == 1 else x.contiguous()
    qweight = qweight.contiguous()
    scales = scales.float().contiguous()
    zeros = zeros.contiguous()
    if mins is not None:
        mins = mins.contiguous()  # [N, G] as scales: the kernel reads it with scales' row stride
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n, block_k = 64, 64
    # Without mins the launch is the plain kernel's (HAS_MINS keeps its default, False).
    extra = {} if mins is None else {"HAS_MINS": True}
    _wna16_linear_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x,
        qweight,
        scales,
        zeros,
        mins if mins is not None else scales,  # never read without HAS_MINS
        bias if bias is not None else scales,  # never read without HAS_BIAS
        out,
        m,
        n,
        k,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        out.stride(0),
        group_size,
        BITS=bits,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        **extra,
    )
    return out


# --- CPU -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WNA16CPUWeight:
    """A WNA16 weight in the CPU op's layout (`prepare_wna16_cpu`); T = ceil(N / 16) tiles of 16
    output rows, the last one padded with zero words, scales and zeros."""

    packed: torch.Tensor
    """int32 [T, K * bits // 32, 16]: packed[t, i, l] is word i of row 16 t + l (one SIMD load
    holds 32 // bits consecutive k of 16 output rows). 8-bit words as in qweight; 4-bit words hold
    the even k of the word in their low 16 bits and the odd k in the high ones (slot j holds k
    offset `_NIBBLE_ORDER[j]`), so one shift moves a pair (k, k + 1) into two bfloat16 halves."""
    scales: torch.Tensor
    """float32 [T, K // group_size, 16]: scales[t, g, l] = scales[16 t + l, g]; float16 where every
    scale is exactly a float16 (GGUF's Q4_0, Q8_0): half the bytes, the same values."""
    zeros: torch.Tensor
    """float32 [T, K // group_size, 16]: the zero points as floats (exact), same order as scales;
    with mins, z' = z + m / s (rounded once; z where s == 0), so s * (u - z') = (u - z) * s - m up
    to rounding. A 0-dim float32 where every group's zero point is the same (symmetric weights):
    none stored, so a 4-bit group of 32 reads 18 bytes, not 24."""
    bits: int
    group_size: int
    out_features: int
    """N."""
    in_features: int
    """K."""


_MAX_FOLDED_SHIFT = 2.0**120
"""Bound on |m / s| for a fold (`cpu_folds_mins`): z + m / s stays far within float32's range."""


def _folded_mins(
    scales: torch.Tensor, mins: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For scales and mins [N, G]: (m / s float64, 0 where s == 0; the groups that are the
    constant -m (s == 0, m != 0); whether each group folds: |m / s| at most `_MAX_FOLDED_SHIFT`
    (so not NaN) where s != 0, m finite where s == 0)."""
    s = scales.detach().cpu().double()
    m = mins.detach().cpu().double()
    nonzero = s != 0
    shift = torch.where(nonzero, m / torch.where(nonzero, s, 1.0), 0.0)
    ok = torch.where(nonzero, shift.abs() <= _MAX_FOLDED_SHIFT, m.isfinite())
    return shift, ~nonzero & (m != 0), ok


def cpu_folds_mins(scales: torch.Tensor, mins: torch.Tensor) -> bool:
    """Whether `prepare_wna16_cpu(..., mins=mins)` can fold these mins into zero points (z + m / s):
    for every group s != 0 with m / s finite and far within float32's range, or s == 0 with m
    finite (the constant -m, stored exactly as u = 0, z = 1, s = m). Where False (a NaN or
    infinite minimum, an overflowing m / s), use the twin (`wna16_linear_torch`) or the Triton
    kernel."""
    if scales.shape != mins.shape:
        raise ValueError(
            f"mins must have scales' shape {tuple(scales.shape)}, got {tuple(mins.shape)}"
        )
    return bool(_folded_mins(scales, mins)[2].all())


def _fold_mins(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    bits: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(zero points, scales, qweight) on the host with the mins folded in: z' = z + m / s
    (float64, rounded once); a group with s == 0 and m != 0 is the constant -m, stored as u = 0,
    z' = 1, s' = m, which the op computes exactly as (0 - 1) * m. ValueError where a group cannot
    fold (`cpu_folds_mins`)."""
    shift, constant, ok = _folded_mins(scales, mins)
    if not ok.all():
        row, group = (int(i) for i in (~ok).nonzero()[0])
        raise ValueError(
            f"mins cannot fold into zero points for the CPU op: group {group} of row {row} has "
            f"scale {scales[row, group].item()!r} and min {mins[row, group].item()!r} "
            "(m / s must be finite, and m finite): use wna16_linear_torch instead"
        )
    zero_points = (zeros.cpu().double() + shift).float()
    if constant.any():
        n, k = qweight.shape[0], qweight.shape[1] * 32 // bits
        zero_points[constant] = 1.0
        scales = torch.where(constant, mins.cpu().float(), scales)
        u = unpack_wna16(qweight, bits, k).view(n, k // group_size, group_size).clone()
        u[constant] = 0
        qweight = pack_wna16(u.view(n, k), bits)
    return zero_points, scales, qweight


def prepare_wna16_cpu(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bits: int,
    *,
    mins: torch.Tensor | None = None,
) -> WNA16CPUWeight:
    """Repack a contract weight once (at load) for `wna16_linear_cpu`; plain PyTorch, so it runs
    whether or not the C++ library is loaded. mins are folded into the zero points
    (`WNA16CPUWeight.zeros`): the op's results are then within rounding of the twin's, not
    bit-identical. ValueError where they cannot fold (`cpu_folds_mins` False)."""
    n, k = _check_layout(qweight, scales, zeros, group_size, bits, mins=mins)
    zero_points, scales, qweight = zeros.cpu().float(), scales.cpu().float(), qweight.cpu()
    if mins is not None:
        zero_points, scales, qweight = _fold_mins(qweight, scales, zeros, mins, group_size, bits)
    if bits == 4:
        u = unpack_wna16(qweight, bits, k).view(n, k // 8, 8)[:, :, list(_NIBBLE_ORDER)]
        qweight = pack_wna16(u.reshape(n, k), bits)
    tiles = -(-n // _CPU_TILE)
    pad = tiles * _CPU_TILE - n

    def tiled(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        t = torch.nn.functional.pad(t.to(dtype), (0, 0, 0, pad))
        return t.view(tiles, _CPU_TILE, t.shape[1]).transpose(1, 2).contiguous()

    # The compact forms (the padding rows' scale 0 makes their zero point irrelevant).
    scale_dtype = torch.float16 if _exact_in_float16(scales) else torch.float32
    one_zero = bool((zero_points == zero_points.flatten()[0]).all())
    return WNA16CPUWeight(
        packed=tiled(qweight, torch.int32),
        scales=tiled(scales, scale_dtype),
        zeros=zero_points.flatten()[0].clone() if one_zero else tiled(zero_points, torch.float32),
        bits=bits,
        group_size=group_size,
        out_features=n,
        in_features=k,
    )


def _exact_in_float16(scales: torch.Tensor) -> bool:
    """Whether every float32 scale is a float16 value (NaN never counts as one)."""
    return torch.equal(scales.half().float(), scales)


MAX_INT8_CHUNK = 256
"""Longest run of K one activation scale covers on the dynamic int8 path (kMaxChunk in the C++)."""


def int8_chunk(group_size: int, bits: int) -> int:
    """The run of K each dynamic int8 activation scale covers: the group, or for longer groups
    the largest divisor of it within `MAX_INT8_CHUNK` that holds whole words."""
    per_word = 32 // bits
    chunk = group_size
    if chunk > MAX_INT8_CHUNK:
        chunk = MAX_INT8_CHUNK - MAX_INT8_CHUNK % per_word
        while group_size % chunk:
            chunk -= per_word
    return chunk


def quantize_activations_int8(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq float32 [M, K] holding int8 values, scale float32 [M, K // chunk]) of x [M, K]: per row
    and chunk, round-half-even(x * (127 / max|x|)) and max|x| / 127 (the module docstring)."""
    m, k = x.shape
    xc = x.float().view(m, k // chunk, chunk)
    amax = xc.abs().amax(-1, keepdim=True)
    # A true float32 division (as the C++ does): `127.0 / amax` would be 127 * reciprocal(amax).
    # Bounded so that a subnormal chunk stays finite; a chunk holding NaN gets xq 0, scale NaN.
    inv = (torch.full_like(amax, 127.0) / amax).clamp(max=torch.finfo(torch.float32).max)
    inv = torch.where(amax > 0, inv, torch.zeros_like(amax))
    return torch.round(xc * inv).view(m, k), (amax / 127.0).squeeze(-1)


def wna16_linear_int8_torch(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bits: int,
    bias: torch.Tensor | None = None,
    *,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dynamic int8 path's twin (the module docstring): x's chunks quantized to int8, each
    chunk's exact dot with u - z scaled by scale_w * scale_x (less min_w * scale_x * sum(xq) with
    mins), summed in float64, rounded once (the op folds the chunks in float32: within a bfloat16
    ulp of this)."""
    n, k = _check_layout(qweight, scales, zeros, group_size, bits, mins=mins)
    _check_x(x, k, bias, n)
    if bits != 4:
        raise ValueError(f"the dynamic int8 path takes 4-bit weights only, got bits={bits}")
    chunk = int8_chunk(group_size, bits)
    xq, sx = quantize_activations_int8(x, chunk)
    h = k // chunk
    u = unpack_wna16(qweight, bits, k).double()
    per_chunk = group_size // chunk
    z = zeros.double().repeat_interleave(per_chunk, 1)  # [N, H]
    s = scales.double().repeat_interleave(per_chunk, 1)
    # [M, H, 1, chunk] x [1, H, N, chunk] -> the exact int dots [M, H, N]
    dots = torch.einsum("mhc,nhc->mhn", xq.double().view(-1, h, chunk), u.view(n, h, chunk))
    qsum = xq.double().view(-1, h, chunk).sum(-1, keepdim=True)
    sx = sx.double().unsqueeze(-1)  # [M, H, 1]
    y = (dots - z.T.unsqueeze(0) * qsum) * s.T.unsqueeze(0) * sx
    if mins is not None:
        y = y - mins.double().repeat_interleave(per_chunk, 1).T.unsqueeze(0) * sx * qsum
    y = y.sum(1)
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def wna16_int8_dot() -> bool:
    """Whether `wna16_linear_cpu(..., dynamic_int8=True)` takes the int8 path here: the C++ library
    is loaded and built for AVX2 (vpmaddubsw), or for AVX-512 on a CPU with AVX512-VNNI."""
    return cpu_extension.load() and bool(torch.ops.llm_cpu.wna16_int8_dot())


AMX_GEMM_MIN_ROWS = {False: 32, True: 192}
"""On a CPU with AMX and bfloat16 x, from how many rows the op's dequantize-then-GEMM path (oneDNN's
bfloat16 GEMM runs on the AMX tiles) beats its decode kernels: keyed by `dynamic_int8`, 32 rows
against the bfloat16-dot kernel, 192 against the int8 one. Measured on Sapphire Rapids, 4-bit g128,
Llama-3.2-1B's qkv / gate_up / down, 1 and 2 threads (2 threads, ms, decode-bf16 / decode-int8 /
GEMM: M = 32: 2.0 / 0.46 / 1.8, 10.3 / 2.3 / 9.0, 5.3 / 1.2 / 4.3; M = 192: 12.9 / 2.9 / 2.6,
61.0 / 14.1 / 13.4, 30.7 / 6.5 / 5.6; M = 512: - / 6.8 / 3.8, - / 43.2 / 19.8, - / 21.5 / 17.8).
Without AMX the build's own crossover holds (kAutoGemmMinRows in the C++: AVX-512 never)."""


def gemm_min_rows(dtype: torch.dtype, dynamic_int8: bool) -> int:
    """`wna16_linear_cpu`'s gemm_min_rows for x of `dtype`: AMX_GEMM_MIN_ROWS in bfloat16 on a CPU
    with AMX, else -1 (the build's crossover)."""
    if dtype == torch.bfloat16 and _has_amx():
        return AMX_GEMM_MIN_ROWS[dynamic_int8]
    return -1


@functools.cache
def _has_amx() -> bool:
    return bool(torch.cpu._is_amx_tile_supported()) and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def wna16_cpu_takes(x: torch.Tensor) -> bool:
    """Whether `wna16_linear_cpu` takes x: the C++ library is loaded, x is a CPU float32 or
    bfloat16 tensor. Otherwise call `wna16_linear_torch` (or the Triton kernel on CUDA)."""
    return x.dtype in (torch.float32, torch.bfloat16) and cpu_extension.takes(x)


def wna16_linear_cpu(
    x: torch.Tensor,
    prepared: WNA16CPUWeight,
    bias: torch.Tensor | None = None,
    gemm_min_rows: int = -1,
    dynamic_int8: bool = False,
) -> torch.Tensor:
    """`wna16_linear_torch`'s contract on a prepared weight through the C++ op; only where
    `wna16_cpu_takes(x)`. x [M, K] float32 or bfloat16 (any row stride; a strided K is copied)
    -> [M, N] in x's dtype. `gemm_min_rows`: from how many rows the op dequantizes blocks of the
    weight for a GEMM instead of unpacking per FMA (`gemm_min_rows()`: what the layers pass); -1:
    the crossover measured for the build's ISA
    (AVX-512, and AVX2 on the int8 path: never; AVX2: 64 rows; baseline: always; kAutoGemmMinRows
    in the C++).
    `dynamic_int8`: `wna16_linear_int8_torch`'s contract instead, where it applies (4-bit
    weights, fewer than gemm_min_rows rows, `wna16_int8_dot()`); elsewhere ignored."""
    _check_x(x, prepared.in_features, bias, prepared.out_features)
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x must be float32 or bfloat16 for the CPU op, got {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    return torch.ops.llm_cpu.wna16_linear(
        x,
        prepared.packed,
        prepared.scales,
        prepared.zeros,
        prepared.bits,
        prepared.group_size,
        prepared.out_features,
        bias,
        gemm_min_rows,
        dynamic_int8,
    )
