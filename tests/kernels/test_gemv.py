"""Blocked GEMV (kernels/gemv.py): the layout against one written out by hand, the twin against
F.linear, the C++ op against the twin (float32 and bfloat16, 1 to 17 rows, K not a multiple of the
vector width or odd, N not a multiple of the block, several block widths, bias, strided x), the view
of oneDNN's packed bytes (found where oneDNN packs that way, refused for another weight) and the
plain read's checksum.

Tolerances (relative, conftest.TOLERANCE): float32 1e-5, bfloat16 1.6e-2.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from kernels import gemv

# Not `dtype`: tests/kernels/conftest.py parametrizes that name itself (bfloat16 skipped on CPU).
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["float32", "bfloat16"]


def _weight(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- layout and twin ------------------------------------------------------------------------------


def test_block_weight_layout_by_hand():
    """bfloat16 (P = 2), N = 3 in blocks of 2, K = 3 padded to 4: element (b, i, j, q) is
    W[2 b + j, 2 i + q], zero past N and K."""
    w = torch.arange(1, 10, dtype=torch.float32).view(3, 3).bfloat16()
    got = gemv.block_weight(w, 2)
    assert got.shape == (2, 2, 2, 2)
    want = [
        [[[1, 2], [4, 5]], [[3, 0], [6, 0]]],
        [[[7, 8], [0, 0]], [[9, 0], [0, 0]]],
    ]
    assert got.float().tolist() == want
    torch.testing.assert_close(gemv.unblock_weight(got, 3, 3), w, rtol=0, atol=0)


@pytest.mark.parametrize("cpu_dtype", DTYPES, ids=DTYPE_IDS)
def test_twin_matches_f_linear(cpu_dtype):
    w, x, bias = _weight(70, 33, cpu_dtype), _x(5, 33, cpu_dtype), torch.randn(70)
    blocked = gemv.block_weight(w, 16, 48)
    want = F.linear(x.float(), w.float(), bias).to(cpu_dtype)
    assert torch.equal(gemv.blocked_gemv_torch(x, blocked, 70, bias), want)


@pytest.mark.parametrize(
    "bad",
    [
        {"blocked": torch.zeros(2, 4, 16, 2)},  # float32 with P = 2
        {"n": 33},  # 2 blocks of 16 cannot hold 33 rows
        {"n": 16},  # nor leave a whole block empty
        {"x": torch.zeros(1, 70)},  # more inputs than the layout holds
    ],
)
def test_twin_rejects_a_mismatched_layout(bad):
    args = {"x": torch.zeros(1, 4), "blocked": torch.zeros(2, 4, 16, 1), "n": 20} | bad
    with pytest.raises(ValueError):
        gemv.blocked_gemv_torch(args["x"], args["blocked"], args["n"])


# --- the C++ op -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cpu_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 17])
@pytest.mark.parametrize(
    ("n", "k", "block_n", "k_padded"),
    [
        (128, 64, 64, 64),  # whole blocks, K a multiple of every vector width
        (100, 70, 64, 80),  # N past a block, K padded as oneDNN pads it
        (130, 33, 32, 34),  # odd K: bfloat16's last pair half padding
        (48, 1, 16, 2),  # a single input
        (37, 200, 48, 200),  # three vectors per block, a partial last block
        (256, 300, 128, 320),  # a block wider than a register tile: several passes
    ],
)
def test_cpu_op_matches_twin(cpu_kernels, assert_close, cpu_dtype, m, n, k, block_n, k_padded):
    w = _weight(n, k, cpu_dtype)
    blocked = gemv.block_weight(w, block_n, k_padded)
    x = _x(m, k, cpu_dtype)
    assert gemv.blocked_gemv_cpu_takes(x, blocked)
    got = gemv.blocked_gemv_cpu(x, blocked, n)
    assert got.shape == (m, n) and got.dtype == cpu_dtype
    assert_close(got, gemv.blocked_gemv_torch(x, blocked, n), cpu_dtype)


@pytest.mark.parametrize("cpu_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_cpu_op_adds_the_bias(cpu_kernels, assert_close, cpu_dtype, bias_dtype):
    n, k = 200, 96  # several blocks: each adds its own slice of the bias
    blocked, x = gemv.block_weight(_weight(n, k, cpu_dtype), 64), _x(3, k, cpu_dtype)
    bias = torch.randn(n).to(bias_dtype)
    got = gemv.blocked_gemv_cpu(x, blocked, n, bias)
    assert_close(got, gemv.blocked_gemv_torch(x, blocked, n, bias), cpu_dtype)


@pytest.mark.parametrize("cpu_dtype", DTYPES, ids=DTYPE_IDS)
def test_cpu_op_takes_strided_x(cpu_kernels, assert_close, cpu_dtype):
    n, k = 70, 40
    blocked = gemv.block_weight(_weight(n, k, cpu_dtype), 32)
    wide = _x(4, 2 * k + 1, cpu_dtype)
    for x in (wide[:, 1 : k + 1], wide[:, : 2 * k : 2], wide[1:3, 3 : k + 3]):
        assert_close(
            gemv.blocked_gemv_cpu(x, blocked, n), gemv.blocked_gemv_torch(x, blocked, n), cpu_dtype
        )


def test_cpu_op_threads_give_the_same_result(cpu_kernels):
    """The blocks are split over the threads: every split sums each output in the same order."""
    n, k = 1000, 256
    blocked, x = gemv.block_weight(_weight(n, k, torch.float32), 64), _x(2, k, torch.float32)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemv.blocked_gemv_cpu(x, blocked, n)
        torch.set_num_threads(2)
        assert torch.equal(gemv.blocked_gemv_cpu(x, blocked, n), one)
    finally:
        torch.set_num_threads(previous)


def test_cpu_op_rejects_bad_arguments(cpu_kernels):
    blocked = gemv.block_weight(_weight(64, 32, torch.float32), 64)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.llm_cpu.blocked_gemv(_x(1, 32, torch.bfloat16), blocked, 64, None)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.llm_cpu.blocked_gemv(_x(1, 32, torch.float32), blocked, 65, None)
    with pytest.raises(RuntimeError, match="cover"):
        torch.ops.llm_cpu.blocked_gemv(_x(1, 40, torch.float32), blocked, 64, None)


# --- oneDNN's packed weights ----------------------------------------------------------------------


def _onednn_packs(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize("cpu_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("n", "k"), [(192, 128), (100, 70)])
def test_onednn_view_is_checked_bytes_of_the_packed_weight(
    cpu_kernels, assert_close, cpu_dtype, n, k
):
    """Where oneDNN packs in the contract's layout the view is exactly `block_weight` of the
    weight, so the op on it gives the twin's result; another weight's packed bytes are refused."""
    if not _onednn_packs(cpu_dtype):
        pytest.skip(f"oneDNN does not pack {cpu_dtype} here")
    w = _weight(n, k, cpu_dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    view = gemv.onednn_blocked_view(packed, w)
    if view is None:
        pytest.skip("oneDNN packs another layout on this CPU: the oneDNN path serves every M")
    _, kp, bn, p = view.shape
    assert torch.equal(view, gemv.block_weight(w, bn, kp * p))
    assert gemv.onednn_blocked_view(packed, _weight(n, k, cpu_dtype, seed=7)) is None
    del packed
    gc.collect()  # the view holds the packed tensor alive
    x = _x(2, k, cpu_dtype)
    assert_close(gemv.blocked_gemv_cpu(x, view, n), gemv.blocked_gemv_torch(x, view, n), cpu_dtype)


def test_onednn_view_needs_a_packed_tensor():
    w = _weight(64, 64, torch.float32)
    assert gemv.onednn_blocked_view(w, w) is None


# --- the plain read -------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [0, 4, 100, 4096, 1 << 16])
def test_stream_read_sums_every_word(cpu_kernels, nbytes):
    gen = torch.Generator().manual_seed(nbytes)
    raw = torch.randint(0, 256, (nbytes + 3,), generator=gen, dtype=torch.uint8)
    tensors = [raw[:nbytes], raw[: nbytes // 2 * 2].view(torch.int16)]
    want = 0
    for t in tensors:
        flat = t.view(torch.uint8)
        words = flat[: flat.numel() // 4 * 4].view(torch.int32).to(torch.int64) % (1 << 32)
        want += int(words.sum())
    assert gemv.stream_read_cpu(tensors) == want % (1 << 32)
