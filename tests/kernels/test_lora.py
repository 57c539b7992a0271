"""add_lora (batched multi-LoRA): the PyTorch version against a row-by-row float64 reference
written here (each row's own adapter, base rows untouched), the Triton kernels against the PyTorch
version in float32 and float16, and the segment builder."""

from __future__ import annotations

import pytest
import torch

from kernels import kernel_ops
from kernels.lora import add_lora_torch, add_lora_triton, lora_segments


def _case(row_slots: list[int], k: int, n: int, rank: int, slots: int, dtype, device):
    gen = torch.Generator().manual_seed(len(row_slots) * 31 + k + n + rank)
    t = len(row_slots)
    x = torch.randn(t, k, generator=gen)
    a = torch.randn(slots, rank, k, generator=gen) / k**0.5
    b = torch.randn(slots, n, rank, generator=gen) / rank**0.5
    out = torch.randn(t, n, generator=gen)
    return [v.to(device, dtype) for v in (out, x, a, b)]


def _reference(out, x, a, b, row_slots):
    want = out.double().clone()
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            want[row] += b[slot].double() @ (a[slot].double() @ x[row].double())
    return want


LAYOUTS = {
    # Base rows first, then adapters in runs (the runner's order).
    "runs": [-1, -1, 0, 0, 0, 2, 2, 1],
    "all-one-adapter": [1] * 5,
    "interleaved": [0, -1, 1, 1, -1, 0, 2, -1, 2, 2],
    "long-segment": [-1] * 3 + [0] * 37 + [1] * 20,  # > one 16-row block per segment
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("k,n,rank", [(64, 48, 8), (40, 100, 24), (128, 64, 3)])
def test_torch_matches_row_by_row_reference(layout, k, n, rank):
    row_slots = LAYOUTS[layout]
    out, x, a, b = _case(row_slots, k, n, rank, 3, torch.float32, "cpu")
    want = _reference(out, x, a, b, row_slots)
    add_lora_torch(out, x, a, b, lora_segments(row_slots, torch.device("cpu")))
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("k,n,rank", [(64, 48, 8), (40, 100, 48), (96, 130, 3)])
def test_triton_matches_torch(device, dtype, assert_close, run_poisoned, layout, k, n, rank):
    # 48 ranks: the fused q/k/v shape (3 x 16); 130 columns: several 64-column programs, a tail.
    row_slots = LAYOUTS[layout]
    out, x, a, b = _case(row_slots, k, n, rank, 3, dtype, device)
    segments = lora_segments(row_slots, device)
    want = out.clone()
    add_lora_torch(want, x, a, b, segments)
    run_poisoned(add_lora_triton, out, x, a, b, segments)
    assert_close(out, want, dtype)
    base_rows = [r for r, s in enumerate(row_slots) if s < 0]
    assert torch.equal(out[base_rows], _case(row_slots, k, n, rank, 3, dtype, device)[0][base_rows])


def test_segments_are_runs_of_one_slot():
    segments = lora_segments([-1, 0, 0, 2, 2, -1, 0], torch.device("cpu"))
    assert segments.bounds == ((1, 3, 0), (3, 5, 2), (6, 7, 0))
    assert segments.starts.tolist() == [1, 3, 6] and segments.ends.tolist() == [3, 5, 7]
    assert segments.slots.tolist() == [0, 2, 0] and segments.max_rows == 2
    assert segments.starts.dtype == torch.int32
    assert lora_segments([-1, -1], torch.device("cpu")) is None
    assert lora_segments([], torch.device("cpu")) is None


def test_kernel_ops_carry_the_lora_kernels():
    assert kernel_ops("torch").add_lora is add_lora_torch
    assert kernel_ops("triton").add_lora is add_lora_triton
