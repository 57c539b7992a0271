"""WNA16 linear (kernels/wna16_linear.py): the packing against the layout written out by hand, the
dequantization against an element-by-element formula on the raw words, the C++ CPU op (both its
decode and GEMM paths, and the dynamic int8 activations of its AVX512-VNNI and AVX2 paths) and
the Triton kernel (interpreter on CPU: float32 and float16) against the PyTorch twins, strided
x, and bad arguments; float minimums (GGUF's Q4_1 and K-quants) bit for bit against gguf-py's
dequantization, and through every path (the C++ op's folded into its zero points).

Tolerances (relative, conftest.TOLERANCE): float32 1e-5, float16 2e-3, bfloat16 1.6e-2.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from kernels import cpu_extension
from kernels.wna16_linear import (
    cpu_folds_mins,
    dequantize_wna16,
    int8_chunk,
    pack_wna16,
    prepare_wna16_cpu,
    quantize_activations_int8,
    unpack_wna16,
    wna16_cpu_takes,
    wna16_int8_dot,
    wna16_linear_cpu,
    wna16_linear_int8_torch,
    wna16_linear_torch,
    wna16_linear_triton,
)

# Not `dtype`: tests/kernels/conftest.py parametrizes that name itself (bfloat16 skipped on CPU).
CPU_DTYPES = [torch.float32, torch.bfloat16]
CPU_DTYPE_IDS = ["float32", "bfloat16"]


def _weight(n: int, k: int, group_size: int, bits: int, seed: int = 0):
    """A random weight in the contract's layout, asymmetric zero points: (qweight, scales, zeros)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 1 << bits, (n, k), generator=gen)
    scales = (torch.rand(n, k // group_size, generator=gen) + 0.5) / (k * (1 << bits)) ** 0.5
    zeros = torch.randint(0, 1 << bits, (n, k // group_size), generator=gen).to(torch.uint8)
    return pack_wna16(u, bits), scales, zeros


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got.double() - want.double()).abs().max()
    return (diff / want.double().abs().max().clamp_min(1e-30)).item()


# --- layout ---------------------------------------------------------------------------------------


def test_pack_follows_the_layout_written_out():
    # 4-bit: element k is nibble k % 8 of word k // 8; 8-bit: byte k % 4 of word k // 4.
    u4 = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 15, 0, 0, 0, 0, 0, 0, 9]])
    assert pack_wna16(u4, 4).tolist() == [[0x87654321 - (1 << 32), 0x9000000F - (1 << 32)]]
    u8 = torch.tensor([[0x11, 0x22, 0x33, 0xF4]])
    assert pack_wna16(u8, 8).tolist() == [[0xF4332211 - (1 << 32)]]


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_roundtrip(bits):
    u = torch.randint(0, 1 << bits, (7, 64), generator=torch.Generator().manual_seed(bits))
    u[0] = (1 << bits) - 1  # words with the top bit set (negative int32)
    qweight = pack_wna16(u, bits)
    assert qweight.dtype == torch.int32 and qweight.shape == (7, 64 * bits // 32)
    got = unpack_wna16(qweight, bits, 64)
    assert got.dtype == torch.uint8 and torch.equal(got.long(), u)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [8, 32, 64])
def test_dequantize_matches_elementwise_formula(bits, group_size):
    n, k = 5, 64
    qweight, scales, zeros = _weight(n, k, group_size, bits)
    got = dequantize_wna16(qweight, scales, zeros, group_size, bits)
    assert got.dtype == torch.float32 and got.shape == (n, k)
    words = qweight.tolist()
    want = torch.empty(n, k)
    for r in range(n):
        for c in range(k):
            word = words[r][c * bits // 32] & 0xFFFFFFFF
            u = (word >> ((c * bits) % 32)) & ((1 << bits) - 1)
            g = c // group_size
            want[r, c] = (u - int(zeros[r, g])) * scales[r, g].item()
    assert torch.equal(got, want)


def test_symmetric_zero_points_give_signed_values():
    qweight = pack_wna16(torch.tensor([[0, 7, 8, 15, 1, 2, 3, 4]]), 4)
    w = dequantize_wna16(qweight, torch.ones(1, 1), torch.full((1, 1), 8, dtype=torch.uint8), 8, 4)
    assert w.tolist() == [[-8, -1, 0, 7, -7, -6, -5, -4]]


def test_torch_twin_is_the_float64_dequantized_matmul():
    qweight, scales, zeros = _weight(48, 128, 32, 4)
    x, bias = _x(9, 128, torch.float32), torch.randn(48)
    got = wna16_linear_torch(x, qweight, scales, zeros, 32, 4, bias)
    w = dequantize_wna16(qweight, scales, zeros, 32, 4).double()
    want = x.double() @ w.T + bias.double()
    assert got.dtype == torch.float32 and _relative_error(got, want) <= 1e-6


# --- C++ CPU op -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cpu_dtype", CPU_DTYPES, ids=CPU_DTYPE_IDS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    "group_size", [32, 64, 128, 256], ids=["g32", "g64", "g128", "per_channel"]
)
def test_cpu_op_matches_twin(cpu_kernels, assert_close, cpu_dtype, bits, group_size):
    n, k = 72, 256  # n: 4 tiles and a half, so the register tiles of 64 rows, 32 and 16 all run
    qweight, scales, zeros = _weight(n, k, group_size, bits)
    prepared = prepare_wna16_cpu(qweight, scales, zeros, group_size, bits)
    for m in (1, 3, 17, 64):
        for bias in (None, torch.randn(n).to(cpu_dtype)):
            x = _x(m, k, cpu_dtype, seed=m)
            want = wna16_linear_torch(x, qweight, scales, zeros, group_size, bits, bias)
            # The decode kernel, then the dequantize-and-GEMM path on the same call.
            for gemm_min_rows in (1 << 30, 1):
                got = wna16_linear_cpu(x, prepared, bias, gemm_min_rows=gemm_min_rows)
                assert got.shape == (m, n)
                assert_close(got, want, cpu_dtype)


@pytest.mark.parametrize("cpu_dtype", CPU_DTYPES, ids=CPU_DTYPE_IDS)
def test_cpu_op_default_path_and_larger_k(cpu_kernels, assert_close, cpu_dtype):
    qweight, scales, zeros = _weight(40, 1024, 128, 4, seed=3)
    prepared = prepare_wna16_cpu(qweight, scales, zeros, 128, 4)
    x = _x(16, 1024, cpu_dtype)
    assert_close(
        wna16_linear_cpu(x, prepared),
        wna16_linear_torch(x, qweight, scales, zeros, 128, 4),
        cpu_dtype,
    )


@pytest.mark.parametrize("bits,k", [(4, 520), (8, 1040)])
def test_cpu_op_long_groups_split_into_chunks(cpu_kernels, assert_close, bits, k):
    # Per-channel groups longer than the kernel's 256-k chunk and not a multiple of it (chunks of
    # 104 and 208): every chunk folded with its group's scale and zero point.
    qweight, scales, zeros = _weight(24, k, k, bits, seed=k)
    prepared = prepare_wna16_cpu(qweight, scales, zeros, k, bits)
    for cpu_dtype in CPU_DTYPES:
        x = _x(5, k, cpu_dtype)
        want = wna16_linear_torch(x, qweight, scales, zeros, k, bits)
        assert_close(wna16_linear_cpu(x, prepared), want, cpu_dtype)


def test_cpu_op_strided_and_empty_x(cpu_kernels, assert_close):
    qweight, scales, zeros = _weight(32, 128, 64, 8)
    prepared = prepare_wna16_cpu(qweight, scales, zeros, 64, 8)
    wide = _x(5, 160, torch.float32)
    rows = wide[:, 16:144]  # row stride 160
    want = wna16_linear_torch(rows.contiguous(), qweight, scales, zeros, 64, 8)
    assert_close(wna16_linear_cpu(rows, prepared), want, torch.float32)
    transposed = rows.T.contiguous().T  # unit stride along M, copied by the entry
    assert_close(wna16_linear_cpu(transposed, prepared), want, torch.float32)
    assert wna16_linear_cpu(rows[:0], prepared).shape == (0, 32)


# --- dynamic int8 activations -----------------------------------------------------------------

needs_int8_dot = pytest.mark.skipif(
    not wna16_int8_dot(),
    reason="the int8 path needs the C++ kernels built for AVX2, or AVX-512 on a CPU with AVX512-VNNI",
)


def _within_a_bfloat16_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """Each element of got (bfloat16) within one bfloat16 ulp of want's (the op folds chunks in
    float32, the twin in float64: only the final rounding may differ)."""
    got, want = got.double(), want.double()
    slack = want.abs() * 2.0**-7 + want.abs().max() * 1e-6
    assert ((got - want).abs() <= slack).all(), (got - want).abs().max().item()


def test_int8_chunk_is_the_group_or_a_divisor_within_256():
    assert [int8_chunk(g, 4) for g in (32, 128, 256, 512, 520, 1024)] == [
        32,
        128,
        256,
        256,
        104,
        256,
    ]
    assert int8_chunk(1040, 8) == 208


def test_activation_quantization_is_symmetric_round_half_even_per_chunk():
    x = torch.tensor([[62.5, -127.0, 63.5, 1.25, 0.0, 0.0, 0.0, 0.0, 0.5, -1.0, 0.25, 0.0]])
    xq, scale = quantize_activations_int8(x, 4)
    # chunk 0: max|x| 127, so x itself rounds, half to even (62.5 -> 62, 63.5 -> 64); chunk 1: all
    # zero; chunk 2: max|x| 1, x * 127.
    assert xq.tolist() == [[62, -127, 64, 1, 0, 0, 0, 0, 64, -127, 32, 0]]
    assert scale.tolist() == [[1.0, 0.0, pytest.approx(1 / 127)]]


@needs_int8_dot
@pytest.mark.parametrize(
    "group_size,k", [(32, 256), (64, 256), (128, 512), (256, 256), (520, 520), (1024, 1024)]
)
def test_cpu_int8_path_matches_its_twin(cpu_kernels, group_size, k):
    n = 72  # 4 tiles and a half: register tiles of 4 tiles and single ones
    qweight, scales, zeros = _weight(n, k, group_size, 4, seed=group_size)
    prepared = prepare_wna16_cpu(qweight, scales, zeros, group_size, 4)
    for m in (1, 2, 3, 4, 5, 17, 130):  # every row tile, a tail, rows quantized in parallel
        for bias in (None, torch.randn(n).bfloat16()):
            x = _x(m, k, torch.bfloat16, seed=m)
            got = wna16_linear_cpu(x, prepared, bias, dynamic_int8=True)
            want = wna16_linear_int8_torch(x, qweight, scales, zeros, group_size, 4, bias)
            assert got.shape == (m, n) and got.dtype == torch.bfloat16
            _within_a_bfloat16_ulp(got, want)


@needs_int8_dot
def test_cpu_int8_path_is_close_to_the_exact_products_and_really_quantizes(cpu_kernels):
    qweight, scales, zeros = _weight(64, 512, 128, 4, seed=7)
    prepared = prepare_wna16_cpu(qweight, scales, zeros, 128, 4)
    x = _x(16, 512, torch.bfloat16)
    exact = wna16_linear_torch(x, qweight, scales, zeros, 128, 4)
    got = wna16_linear_cpu(x, prepared, dynamic_int8=True)
    # int8 rounding of unit-normal activations: ~0.7% of each x, ~1e-2 of the output's scale.
    assert 1e-3 < _relative_error(got, exact) < 3e-2
    assert not torch.equal(got, wna16_linear_cpu(x, prepared))


@needs_int8_dot
def test_cpu_int8_path_strided_zero_and_ignored_cases(cpu_kernels, assert_close):
    qweight, scales, zeros = _weight(32, 128, 64, 4)
    prepared = prepare_wna16_cpu(qweight, scales, zeros, 64, 4)
    wide = _x(5, 160, torch.bfloat16)
    rows = wide[:, 16:144]  # row stride 160
    want = wna16_linear_int8_torch(rows, qweight, scales, zeros, 64, 4)
    _within_a_bfloat16_ulp(wna16_linear_cpu(rows, prepared, dynamic_int8=True), want)
    rows = rows.clone()
    rows[2] = 0  # an all-zero row: scale 0, the bias alone
    bias = torch.randn(32).bfloat16()
    got = wna16_linear_cpu(rows, prepared, bias, dynamic_int8=True)
    assert torch.equal(got[2], bias)
    # A NaN in a row's chunk makes that row's outputs NaN, as the exact path's.
    rows[3, 5] = float("nan")
    got = wna16_linear_cpu(rows, prepared, bias, dynamic_int8=True)
    assert got[3].isnan().all() and not got[4].isnan().any()
    assert wna16_linear_int8_torch(rows, qweight, scales, zeros, 64, 4)[3].isnan().all()
    # Float32 x is quantized the same way (the chunks folded in float32: within its rounding).
    xf = _x(3, 128, torch.float32)
    got = wna16_linear_cpu(xf, prepared, dynamic_int8=True)
    want = wna16_linear_int8_torch(xf, qweight, scales, zeros, 64, 4)
    assert got.dtype == torch.float32 and not torch.equal(got, wna16_linear_cpu(xf, prepared))
    assert_close(got, want, torch.float32)
    # 8-bit weights take the exact path whatever the flag.
    q8, s8, z8 = _weight(32, 128, 64, 8)
    prepared8 = prepare_wna16_cpu(q8, s8, z8, 64, 8)
    xb = _x(3, 128, torch.bfloat16)
    assert torch.equal(
        wna16_linear_cpu(xb, prepared8, dynamic_int8=True), wna16_linear_cpu(xb, prepared8)
    )


def test_prepare_pads_the_last_tile(cpu_kernels):
    qweight, scales, zeros = _weight(20, 64, 32, 4)
    prepared = prepare_wna16_cpu(qweight, scales, zeros, 32, 4)
    assert prepared.packed.shape == (2, 8, 16) and prepared.scales.shape == (2, 2, 16)
    assert not prepared.packed[1, :, 4:].any() and not prepared.scales[1, :, 4:].any()
    assert prepared.out_features == 20 and prepared.in_features == 64


@pytest.mark.parametrize(
    "half_scales,one_zero", [(True, True), (True, False), (False, True)], ids=["q4_0", "f16", "sym"]
)
@pytest.mark.parametrize(
    "bits,group_size", [(4, 32), (8, 32), (4, 256)], ids=["4g32", "8g32", "4pc"]
)
def test_compact_layout_gives_the_full_layouts_bits(
    cpu_kernels, half_scales, one_zero, bits, group_size
):
    # GGUF's Q4_0 and Q8_0: float16 scales, one zero point. The op reads them in their compact
    # forms (fewer bytes) and computes exactly what it computes from float32 copies of both.
    n, k = 72, 256
    qweight, scales, zeros = _weight(n, k, group_size, bits, seed=bits + group_size)
    if half_scales:
        scales = scales.half().float()
    if one_zero:
        zeros = torch.full_like(zeros, 1 << (bits - 1))
    prepared = prepare_wna16_cpu(qweight, scales, zeros, group_size, bits)
    assert prepared.scales.dtype == (torch.float16 if half_scales else torch.float32)
    assert prepared.zeros.shape == (() if one_zero else prepared.scales.shape)
    full = dataclasses.replace(
        prepared,
        scales=prepared.scales.float(),
        zeros=prepared.zeros.expand(prepared.scales.shape).contiguous(),
    )
    if half_scales and one_zero and group_size == 32:  # 18 bytes per 32 4-bit weights, as Q4_0
        held = sum(t.numel() * t.element_size() for t in (prepared.packed, prepared.scales))
        assert held == 80 * k * (bits + 16 / group_size) // 8
    cases = [(d, rows, False) for d in CPU_DTYPES for rows in (1 << 30, 1)]
    if bits == 4 and wna16_int8_dot():
        cases += [(torch.bfloat16, 1 << 30, True), (torch.float32, 1 << 30, True)]
    for cpu_dtype, gemm_min_rows, int8 in cases:
        for m in (1, 3, 5, 17):
            x = _x(m, k, cpu_dtype, seed=m)
            got = wna16_linear_cpu(x, prepared, None, gemm_min_rows, dynamic_int8=int8)
            assert torch.equal(
                got, wna16_linear_cpu(x, full, None, gemm_min_rows, dynamic_int8=int8)
            )
            twin = wna16_linear_int8_torch if int8 else wna16_linear_torch
            want = twin(x, qweight, scales, zeros, group_size, bits)
            assert _relative_error(got, want) < (2e-2 if cpu_dtype == torch.bfloat16 else 1e-5)


def test_cpu_op_gives_the_same_bits_on_any_thread_count(cpu_kernels):
    # The decode call's work items go partly in static runs, partly from a shared counter: which
    # thread computes an item never changes its bits.
    n, k = 1000, 256  # 63 tiles: 16 items, the last one short
    qweight, scales, zeros = _weight(n, k, 32, 4, seed=5)
    prepared = prepare_wna16_cpu(qweight, scales, zeros, 32, 4)
    x = _x(3, k, torch.float32)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append([wna16_linear_cpu(x, prepared, dynamic_int8=i) for i in (False, True)])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(r, results[0], strict=True))


def test_prepare_keeps_the_full_layout_where_scales_or_zeros_vary(cpu_kernels):
    qweight, scales, zeros = _weight(20, 64, 32, 4)
    scales = scales.half().float()
    scales[3, 1] = scales[3, 1].half().float() + 2**-20  # one scale not a float16
    zeros[:] = 8
    zeros[7, 0] = 9  # one zero point apart
    prepared = prepare_wna16_cpu(qweight, scales, zeros, 32, 4)
    assert prepared.scales.dtype == torch.float32 and prepared.zeros.shape == (2, 2, 16)


def test_cpu_takes_only_float32_and_bfloat16_with_the_library(cpu_kernels, monkeypatch):
    assert wna16_cpu_takes(torch.zeros(1, 8))
    assert wna16_cpu_takes(torch.zeros(1, 8, dtype=torch.bfloat16))
    assert not wna16_cpu_takes(torch.zeros(1, 8, dtype=torch.float16))
    monkeypatch.setattr(cpu_extension, "load", lambda: False)
    assert not wna16_cpu_takes(torch.zeros(1, 8))


# --- Triton (interpreter on CPU) ------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 128], ids=["g32", "per_channel"])
def test_triton_matches_twin(device, dtype, assert_close, run_poisoned, bits, group_size):
    n, k = 80, 128  # two column blocks (one partial), two K steps
    qweight, scales, zeros = _weight(n, k, group_size, bits)
    for m, bias in ((1, True), (3, False), (17, True), (64, False)):
        x = _x(m, k, dtype, seed=m)
        b = torch.randn(n).to(dtype) if bias else None
        want = wna16_linear_torch(x, qweight, scales, zeros, group_size, bits, b)
        args = [t if t is None else t.to(device) for t in (x, qweight, scales, zeros)]
        got = run_poisoned(
            wna16_linear_triton, *args, group_size, bits, None if b is None else b.to(device)
        )
        assert_close(got.cpu(), want, dtype)


def test_triton_strided_x(device):
    qweight, scales, zeros = _weight(48, 64, 32, 4)
    wide = _x(6, 96, torch.float32)
    want = wna16_linear_torch(wide[:, :64].contiguous(), qweight, scales, zeros, 32, 4)
    args = [t.to(device) for t in (wide[:, :64], qweight, scales, zeros)]
    got = wna16_linear_triton(*args, 32, 4)
    assert _relative_error(got.cpu(), want) <= 1e-5


# --- float minimums (GGUF's Q4_1 and K-quants) ------------------------------------------------------


def _mins(scales: torch.Tensor, bits: int, seed: int = 2) -> torch.Tensor:
    """Minimums as GGUF's give them: a few scales' worth of offset (either sign) per group."""
    gen = torch.Generator().manual_seed(seed)
    return scales * ((torch.rand(scales.shape, generator=gen) * 1.5 - 0.5) * (1 << bits))


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_with_mins_is_numpy_s_u_minus_m_bit_for_bit(bits):
    n, k, group_size = 6, 128, 32
    qweight, scales, zeros = _weight(n, k, group_size, bits)
    mins = _mins(scales, bits)
    u = unpack_wna16(qweight, bits, k).numpy().astype(np.float32).reshape(n, -1, group_size)
    s, m = scales.numpy()[..., None], mins.numpy()[..., None]
    got = dequantize_wna16(qweight, scales, torch.zeros_like(zeros), group_size, bits, mins=mins)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.from_numpy((s * u - m).reshape(n, k)))
    # With zero points: (u - z) * s, rounded, then - m, rounded.
    z = zeros.numpy().astype(np.float32)[..., None]
    got = dequantize_wna16(qweight, scales, zeros, group_size, bits, mins=mins)
    assert torch.equal(got, torch.from_numpy(((u - z) * s - m).reshape(n, k)))
    # mins=None subtracts nothing; zero mins give the same weight.
    plain = dequantize_wna16(qweight, scales, zeros, group_size, bits)
    assert torch.equal(plain, torch.from_numpy(((u - z) * s).reshape(n, k)))
    zero_mins = torch.zeros_like(mins)
    assert torch.equal(
        dequantize_wna16(qweight, scales, zeros, group_size, bits, mins=zero_mins), plain
    )


def test_gguf_q4_1_blocks_dequantize_exactly_as_gguf():
    n, k = 8, 256
    weights = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    weights[0, :32] = 1.5  # a constant block: d = 0
    blocks = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q4_1)
    want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_1)
    # Per block of 32: float16 d, float16 m, 16 bytes: low nibbles values 0-15, high ones 16-31.
    blocks = blocks.reshape(n, k // 32, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    u = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    got = dequantize_wna16(
        pack_wna16(torch.from_numpy(u.astype(np.int64)), 4),
        torch.from_numpy(d),
        torch.zeros(n, k // 32, dtype=torch.uint8),
        32,
        4,
        mins=torch.from_numpy(-m),
    )
    assert torch.equal(got, torch.from_numpy(want))


def test_torch_twin_with_mins_is_the_float64_dequantized_matmul():
    qweight, scales, zeros = _weight(48, 128, 32, 4)
    mins = _mins(scales, 4)
    x, bias = _x(9, 128, torch.float32), torch.randn(48)
    got = wna16_linear_torch(x, qweight, scales, zeros, 32, 4, bias, mins=mins)
    w = dequantize_wna16(qweight, scales, zeros, 32, 4).double() - mins.double().repeat_interleave(
        32, 1
    )
    want = x.double() @ w.T + bias.double()
    assert got.dtype == torch.float32 and _relative_error(got, want) <= 1e-6
    plain = wna16_linear_torch(x, qweight, scales, zeros, 32, 4, bias)
    assert _relative_error(plain, want) > 1e-2  # the minimums matter


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("with_mins", [False, True], ids=["plain", "mins"])
def test_triton_with_mins_matches_twin(device, run_poisoned, bits, with_mins):
    n, k, group_size = 80, 128, 32  # two column blocks (one partial), two K steps
    qweight, scales, zeros = _weight(n, k, group_size, bits, seed=5)
    mins = _mins(scales, bits) if with_mins else None
    for m, with_bias in ((3, True), (17, False)):
        x = _x(m, k, torch.float32, seed=m)
        bias = torch.randn(n) if with_bias else None
        want = wna16_linear_torch(x, qweight, scales, zeros, group_size, bits, bias, mins=mins)
        args = [t if t is None else t.to(device) for t in (x, qweight, scales, zeros, bias)]
        got = run_poisoned(
            wna16_linear_triton,
            *args[:4],
            group_size,
            bits,
            args[4],
            mins=None if mins is None else mins.to(device),
        )
        assert _relative_error(got.cpu(), want) <= 1e-5


def test_int8_twin_with_mins_is_its_float64_formula():
    n, k, group_size = 24, 512, 512  # per-channel: chunks of 256 sharing a group's min
    qweight, scales, zeros = _weight(n, k, group_size, 4, seed=9)
    mins = _mins(scales, 4)
    x, bias = _x(5, k, torch.float32), torch.randn(n)
    got = wna16_linear_int8_torch(x, qweight, scales, zeros, group_size, 4, bias, mins=mins)
    chunk = int8_chunk(group_size, 4)
    xq, sx = quantize_activations_int8(x, chunk)
    u = unpack_wna16(qweight, 4, k).double()
    want = bias.double().expand(5, n).clone()
    for h in range(k // chunk):
        g = h * chunk // group_size
        xh = xq[:, h * chunk : (h + 1) * chunk].double()
        dots = xh @ (u[:, h * chunk : (h + 1) * chunk] - zeros[:, g, None].double()).T
        s, m = scales[:, g].double(), mins[:, g].double()
        want += sx[:, h, None].double() * (s * dots - m * xh.sum(1, keepdim=True))
    assert got.dtype == torch.float32 and _relative_error(got, want) <= 1e-6
    # Zero minimums subtract exact zeros: the plain path's bits.
    plain = wna16_linear_int8_torch(x, qweight, scales, zeros, group_size, 4, bias)
    zero_mins = torch.zeros_like(mins)
    assert torch.equal(
        wna16_linear_int8_torch(x, qweight, scales, zeros, group_size, 4, bias, mins=zero_mins),
        plain,
    )


@pytest.mark.parametrize("cpu_dtype", CPU_DTYPES, ids=CPU_DTYPE_IDS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 256], ids=["g32", "per_channel"])
def test_cpu_op_with_folded_mins_matches_twin(
    cpu_kernels, assert_close, cpu_dtype, bits, group_size
):
    n, k = 72, 256
    qweight, scales, zeros = _weight(n, k, group_size, bits, seed=group_size + bits)
    mins = _mins(scales, bits)
    prepared = prepare_wna16_cpu(qweight, scales, zeros, group_size, bits, mins=mins)
    for m in (1, 2, 3, 4, 64):
        bias = torch.randn(n).to(cpu_dtype)
        x = _x(m, k, cpu_dtype, seed=m)
        want = wna16_linear_torch(x, qweight, scales, zeros, group_size, bits, bias, mins=mins)
        for gemm_min_rows in (1 << 30, 1):  # decode kernel, dequantize-for-GEMM path
            got = wna16_linear_cpu(x, prepared, bias, gemm_min_rows=gemm_min_rows)
            assert got.shape == (m, n) and got.dtype == cpu_dtype
            if cpu_dtype == torch.bfloat16 and gemm_min_rows == 1 << 30:
                _within_a_bfloat16_ulp(got, want)  # float32 sums, one rounding
            else:  # float32 (~1e-6 measured); the GEMM's weight rounded to bfloat16 (~5e-3)
                assert_close(got, want, cpu_dtype)


@needs_int8_dot
@pytest.mark.parametrize("group_size,k", [(32, 256), (512, 512)])
def test_cpu_int8_path_with_folded_mins_matches_its_twin(cpu_kernels, group_size, k):
    n = 72
    qweight, scales, zeros = _weight(n, k, group_size, 4, seed=group_size)
    mins = _mins(scales, 4)
    prepared = prepare_wna16_cpu(qweight, scales, zeros, group_size, 4, mins=mins)
    for m in (1, 3, 4, 17):
        bias = torch.randn(n).bfloat16()
        x = _x(m, k, torch.bfloat16, seed=m)
        got = wna16_linear_cpu(x, prepared, bias, dynamic_int8=True)
        want = wna16_linear_int8_torch(x, qweight, scales, zeros, group_size, 4, bias, mins=mins)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        _within_a_bfloat16_ulp(got, want)


@pytest.mark.parametrize("bits", [4, 8])
def test_mins_with_a_zero_scale_fold_as_a_constant_group(cpu_kernels, assert_close, bits):
    # A K-quant sub-block whose 6-bit scale rounded to 0 keeps its minimum: w is -m there.
    qweight, scales, zeros = _weight(20, 64, 32, bits)
    mins = _mins(scales, bits)
    scales[3, 1] = 0.0
    assert cpu_folds_mins(scales, mins)
    prepared = prepare_wna16_cpu(qweight, scales, zeros, 32, bits, mins=mins)
    x = _x(3, 64, torch.float32)
    want = wna16_linear_torch(x, qweight, scales, zeros, 32, bits, mins=mins)
    assert_close(wna16_linear_cpu(x, prepared), want, torch.float32)
    assert_close(wna16_linear_cpu(x, prepared, gemm_min_rows=1), want, torch.float32)
    mins[3, 1] = 0.0  # w is 0 there: the zero point stays
    prepared = prepare_wna16_cpu(qweight, scales, zeros, 32, bits, mins=mins)
    assert prepared.zeros[0, 1, 3] == zeros[3, 1]
    want = wna16_linear_torch(x, qweight, scales, zeros, 32, bits, mins=mins)
    assert_close(wna16_linear_cpu(x, prepared), want, torch.float32)
    mins[3, 1] = float("nan")
    assert not cpu_folds_mins(scales, mins)
    with pytest.raises(ValueError, match=r"^mins .*group 1 of row 3"):
        prepare_wna16_cpu(qweight, scales, zeros, 32, bits, mins=mins)


@pytest.mark.parametrize(
    "mins",
    [
        torch.zeros(8, 3),
        torch.zeros(8, 2, dtype=torch.float64),
        torch.zeros(8, 2, dtype=torch.float16),
        torch.zeros(8, 2, dtype=torch.int32),
        torch.zeros(2, 8),
    ],
    ids=["shape", "float64", "float16", "int32", "transposed"],
)
def test_bad_mins_are_rejected_naming_mins(mins):
    qweight, scales, zeros = _weight(8, 64, 32, 4)
    x = torch.zeros(2, 64)
    for call in (
        lambda: dequantize_wna16(qweight, scales, zeros, 32, 4, mins=mins),
        lambda: wna16_linear_torch(x, qweight, scales, zeros, 32, 4, mins=mins),
        lambda: wna16_linear_triton(x, qweight, scales, zeros, 32, 4, mins=mins),
        lambda: wna16_linear_int8_torch(x, qweight, scales, zeros, 32, 4, mins=mins),
        lambda: prepare_wna16_cpu(qweight, scales, zeros, 32, 4, mins=mins),
    ):
        with pytest.raises(ValueError, match="^mins "):
            call()


# --- bad arguments --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change,name",
    [
        (dict(bits=3), "bits"),
        (dict(group_size=48), "group_size"),
        (dict(group_size=4), "group_size"),  # not a multiple of 32 // bits
        (dict(qweight=torch.zeros(8, 8, dtype=torch.int64)), "qweight"),
        (dict(scales=torch.ones(8, 3)), "scales"),
        (dict(zeros=torch.zeros(8, 2)), "zeros"),
        (dict(x=torch.zeros(2, 32)), "x"),
        (dict(bias=torch.zeros(9)), "bias"),
    ],
)
def test_bad_arguments_name_the_argument(change, name):
    qweight, scales, zeros = _weight(8, 64, 32, 4)
    args = dict(
        x=torch.zeros(2, 64),
        qweight=qweight,
        scales=scales,
        zeros=zeros,
        group_size=32,
        bits=4,
        bias=None,
    )
    args.update(change)
    for fn in (wna16_linear_torch, wna16_linear_triton):
        with pytest.raises(ValueError, match=f"^{name} "):
            fn(**args)
    if "x" not in change and "bias" not in change:
        with pytest.raises(ValueError, match=f"^{name} "):
            prepare_wna16_cpu(
                args["qweight"], args["scales"], args["zeros"], args["group_size"], args["bits"]
            )


def test_cpu_entry_rejects_bad_x(cpu_kernels):
    prepared = prepare_wna16_cpu(*_weight(8, 64, 32, 4), 32, 4)
    with pytest.raises(ValueError, match="^x "):
        wna16_linear_cpu(torch.zeros(2, 32), prepared)
    with pytest.raises(ValueError, match="^x "):
        wna16_linear_cpu(torch.zeros(2, 64, dtype=torch.float16), prepared)
    with pytest.raises(ValueError, match="^bias "):
        wna16_linear_cpu(torch.zeros(2, 64), prepared, torch.zeros(7))


def test_pack_rejects_out_of_range_values():
    with pytest.raises(ValueError, match="^u "):
        pack_wna16(torch.tensor([[16, 0, 0, 0, 0, 0, 0, 0]]), 4)
    with pytest.raises(ValueError, match="^bits "):
        unpack_wna16(torch.zeros(1, 1, dtype=torch.int32), 2, 16)
