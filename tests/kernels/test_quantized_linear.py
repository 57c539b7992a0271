"""Quantized linear (kernels/quantized_linear.py): the PyTorch twin against a float64
dequantized reference written here, the Triton kernel against the twin (int8 weights in float32
and float16; bfloat16 only on CUDA, see conftest), and fp8 weights where they can run."""

from __future__ import annotations

import pytest
import torch

from backend_lib.quantization import dequantize_weight, quantize_weight
from kernels.quantized_linear import quantized_linear_torch, quantized_linear_triton

SHAPES = [(1, 64, 48), (5, 100, 130), (33, 64, 200), (70, 96, 64)]  # (M, K, N): tails, >1 block


def _case(m: int, k: int, n: int, mode: str, bias: bool, dtype, device):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    w = torch.randn(n, k, generator=gen) / k**0.5
    q, scale = quantize_weight(w, mode)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = (0.1 * torch.randn(n, generator=gen)).to(dtype) if bias else None
    return [t if t is None else t.to(device) for t in (x, q, scale, b)]


def _reference(x, q, scale, b):
    """float64: x @ (q * scale).T + b, the weights dequantized first."""
    w = q.double() * scale.double()[:, None]
    y = x.double() @ w.T
    return y if b is None else y + b.double()


@pytest.mark.parametrize("mode", ["int8", "fp8"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_torch_twin_matches_float64_dequantized_reference(mode, bias, m, k, n):
    x, q, scale, b = _case(m, k, n, mode, bias, torch.float32, "cpu")
    got = quantized_linear_torch(x, q, scale, b)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    # float32 accumulation over K <= 100 terms: a few ulps of the largest output.
    want = _reference(x, q, scale, b)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_torch_twin_rounds_once_to_the_input_dtype():
    x, q, scale, b = _case(9, 64, 48, "int8", True, torch.float16, "cpu")
    got = quantized_linear_torch(x, q, scale, b)
    assert got.dtype == torch.float16
    assert torch.equal(got, _reference(x, q, scale, b).float().half())


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_triton_int8_matches_torch(device, dtype, assert_close, run_poisoned, bias, m, k, n):
    x, q, scale, b = _case(m, k, n, "int8", bias, dtype, device)
    want = quantized_linear_torch(x, q, scale, b)
    got = run_poisoned(quantized_linear_triton, x, q, scale, b)
    assert_close(got, want, dtype)


def test_triton_handles_strided_rows_and_empty_input(device):
    x, q, scale, _ = _case(6, 64, 48, "int8", False, torch.float32, device)
    wide = torch.zeros(6, 80, device=device)
    wide[:, :64] = x
    got = quantized_linear_triton(wide[:, :64], q, scale)
    torch.testing.assert_close(got, quantized_linear_torch(x, q, scale), rtol=1e-5, atol=1e-5)
    assert quantized_linear_triton(x[:0], q, scale).shape == (0, 48)


def test_triton_fp8_matches_torch(device, assert_close):
    """fp8 (float8_e4m3fn) weights: run on CUDA (compute capability >= 8.9); Triton's CPU
    interpreter is tried too and the test skips if it cannot load or convert fp8."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9+")
    x, q, scale, b = _case(33, 96, 130, "fp8", True, torch.float16, device)
    want = quantized_linear_torch(x, q, scale, b)
    try:
        got = quantized_linear_triton(x, q, scale, b)
    except Exception as e:  # noqa: BLE001  (the interpreter's own failure, whatever its type)
        if device.type == "cuda":
            raise
        pytest.skip(f"Triton's interpreter cannot run fp8 weights: {type(e).__name__}: {e}")
    assert_close(got, want, torch.float16)


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_dequantized_weight_is_close_to_the_float_one(mode):
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_weight(w, mode)
    err = (dequantize_weight(q, scale) - w).abs().amax(dim=1)
    # int8: at most half a step (scale / 2) per element; e4m3 (3 mantissa bits): 2^-4 of the
    # element's magnitude, so at most 1/16 of the row maximum.
    bound = scale / 2 if mode == "int8" else w.abs().amax(dim=1) / 16
    assert (err <= bound * (1 + 1e-6)).all()
