"""Token bitmask: mask the logits of disallowed tokens to -inf (structured outputs).

Contract (both backends): `apply_token_bitmask(logits, bitmask, rows)`, in place on `logits`
[R, V] (float32, float16 or bfloat16): for each b, every token t of row `rows[b]` whose bit
`(bitmask[b, t // 32] >> (t % 32)) & 1` is 0 becomes -inf; other rows and allowed tokens are left
unchanged. `bitmask` [B, W] int32 with W >= ceil(V / 32) (bits past V are ignored), `rows` [B]
int64, both on the logits' device. xgrammar's bitmask layout, so its matchers fill it directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SHIFTS = 32


def apply_token_bitmask_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    """Vectorised PyTorch version (the CPU path): unpack the bits, masked_fill the rows."""
    if rows.numel() == 0:
        return
    vocab = logits.shape[1]
    shifts = torch.arange(_SHIFTS, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    selected = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, selected)


@triton.jit
def _token_bitmask_kernel(
    logits_ptr, bitmask_ptr, rows_ptr, stride_logits, stride_bitmask, vocab, BLOCK: tl.constexpr
):
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab
    row = tl.load(rows_ptr + b)
    words = tl.load(bitmask_ptr + b * stride_bitmask + cols // 32, mask=in_vocab, other=0)
    disallowed = ((words >> (cols % 32)) & 1) == 0
    neg_inf = tl.full([BLOCK], float("-inf"), dtype=logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + cols, neg_inf, mask=in_vocab & disallowed)


def apply_token_bitmask_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    """Triton version of `apply_token_bitmask_torch` (same contract); one program per bitmask
    row and BLOCK tokens, so unconstrained rows are never read."""
    if rows.numel() == 0:
        return
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1, "rows must be contiguous"
    vocab = logits.shape[1]
    block = min(1024, triton.next_power_of_2(vocab))
    grid = (rows.numel(), triton.cdiv(vocab, block))
    _token_bitmask_kernel[grid](
        logits, bitmask, rows, logits.stride(0), bitmask.stride(0), vocab, BLOCK=block
    )
