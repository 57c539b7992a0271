"""Small-M float linear over a weight blocked along its output rows ("blocked GEMV"): the decode
steps' projections on CPU, streaming the weight at memory bandwidth.

Contract, for an out x in = N x K weight W (rows as in checkpoints):

- `blocked` [NB, KP, BN, P] in W's dtype (float32: P = 1; bfloat16: P = 2), element (b, i, j, q) =
  W[b * BN + j, i * P + q], zero past N and K (NB = ceil(N / BN), KP * P >= K): blocks of BN output
  rows, k-major within a block, P consecutive k innermost.
- `blocked_gemv_*(x, blocked, n, bias=None)` returns `x @ W.T + bias` for x [M, K] in the weight's
  dtype, in x's dtype: products accumulated in float32, rounded once.

PyTorch twin (`blocked_gemv_torch`): unblock, float32 matmul, bias, cast; the reference.
C++ op (`blocked_gemv_cpu`, where `blocked_gemv_cpu_takes`): torch.ops.llm_cpu.blocked_gemv
(kernels/csrc/gemv_cpu.cpp): register tiles of up to 4 rows of x by 4 vectors of output rows (a
single row of x: a whole block, 8 vectors on AVX2), one FMA per weight vector and row (bfloat16:
vdpbf16ps on AVX512-BF16, checked at run time; else widened to float32), the blocks split evenly
over the threads, weight lines prefetched ahead on Intel CPUs only (on AMD Zen 3 that cost). Float32 sums in another order than
the twin's: within float32 rounding of it.

Why this layout: it is the one oneDNN packs inner-product weights in on AVX-512 CPUs (float32:
BN 64, P 1; bfloat16: BN 32, P 2; measured on Intel Sapphire Rapids with AMX, torch 2.13's
oneDNN). `onednn_blocked_view` returns the layout as a view of a oneDNN-packed weight's own bytes,
after checking every byte against `block_weight` of the plain weight, so the GEMV (small M) and
oneDNN's GEMM (large M) read one copy. Where oneDNN packs otherwise (another ISA or version, a
shape it lays out differently) the view is None and oneDNN's path serves every M.

`stream_read_cpu(tensors)`: the plain read that bench/gemv_bandwidth.py measures a kernel against:
every byte once, with the build's widest loads, split over the threads as the GEMV splits a weight.
"""

from __future__ import annotations

import torch

from kernels import cpu_extension

PAIR = {torch.float32: 1, torch.bfloat16: 2}
"""P of the layout per dtype: consecutive k innermost (bfloat16's pair is one vdpbf16ps operand)."""
_BLOCK_ROWS = (64, 32, 16, 48, 128)
"""BN values `onednn_blocked_view` tries, the ones seen first (oneDNN on AVX-512: 64 float32, 32
bfloat16); all multiples of 16, the op's vector of output rows in an AVX-512 build."""
_K_MULTIPLES = (1, 2, 4, 8, 16, 32, 64)
"""What oneDNN may round K up to (float32 K 70 was padded to 80)."""


def _check_blocked(blocked: torch.Tensor, n: int, k: int | None = None) -> tuple[int, int, int]:
    """(NB, BN, KP * P) of a valid blocked weight for N = n (and K = k where given)."""
    if blocked.dim() != 4 or blocked.dtype not in PAIR or blocked.shape[3] != PAIR[blocked.dtype]:
        raise ValueError(
            "blocked must be float32 [NB, KP, BN, 1] or bfloat16 [NB, KP, BN, 2], got "
            f"{blocked.dtype} {tuple(blocked.shape)}"
        )
    nb, kp, bn, p = blocked.shape
    if not (nb - 1) * bn < n <= nb * bn:
        raise ValueError(f"n = {n} does not match {nb} blocks of {bn} rows")
    if k is not None and kp * p < k:
        raise ValueError(f"blocked covers {kp * p} inputs, x has K = {k}")
    return nb, bn, kp * p


def block_weight(weight: torch.Tensor, block_n: int, k_padded: int | None = None) -> torch.Tensor:
    """The contract's layout of a float32 or bfloat16 weight [N, K]: [ceil(N / block_n),
    k_padded / P, block_n, P], zero-padded (k_padded: K rounded up to a multiple of P when None)."""
    if weight.dim() != 2 or weight.dtype not in PAIR:
        raise ValueError(f"weight must be float32 or bfloat16 [N, K], got {weight.dtype}")
    n, k = weight.shape
    p = PAIR[weight.dtype]
    k_padded = -(-k // p) * p if k_padded is None else k_padded
    if k_padded < k or k_padded % p:
        raise ValueError(f"k_padded must be at least K = {k} and a multiple of {p}")
    blocks = -(-n // block_n)
    padded = torch.nn.functional.pad(weight, (0, k_padded - k, 0, blocks * block_n - n))
    return padded.view(blocks, block_n, k_padded // p, p).transpose(1, 2).contiguous()


def unblock_weight(blocked: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The weight [n, k] a blocked one stands for (`block_weight`'s inverse)."""
    nb, bn, kpp = _check_blocked(blocked, n, k)
    return blocked.transpose(1, 2).reshape(nb * bn, kpp)[:n, :k]


def blocked_gemv_torch(
    x: torch.Tensor, blocked: torch.Tensor, n: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The contract in plain PyTorch: x [M, K] @ W.T in float32, + bias, in x's dtype."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    w = unblock_weight(blocked, n, x.shape[1])
    y = x.float() @ w.float().T
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def blocked_gemv_cpu_takes(x: torch.Tensor, blocked: torch.Tensor) -> bool:
    """Whether `blocked_gemv_cpu` takes x: the C++ library is loaded, x a CPU tensor of the weight's
    dtype (float32 or bfloat16). Otherwise call `blocked_gemv_torch`."""
    return x.dtype == blocked.dtype and x.dtype in PAIR and cpu_extension.takes(x)


def blocked_gemv_cpu(
    x: torch.Tensor, blocked: torch.Tensor, n: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`blocked_gemv_torch`'s contract through the C++ op; only where `blocked_gemv_cpu_takes`.
    x [M, K] (any row stride; a strided K is copied) -> [M, n] in x's dtype."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    _check_blocked(blocked, n, x.shape[1])
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [N] = [{n}], got {tuple(bias.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    return torch.ops.llm_cpu.blocked_gemv(x, blocked, n, bias)


def _candidates(n: int, k: int, p: int, elements: int) -> list[tuple[int, int]]:
    """(BN, KP * P) pairs whose padded size is `elements`, in `_BLOCK_ROWS` order."""
    found = []
    for bn in _BLOCK_ROWS:
        for multiple in _K_MULTIPLES:
            kpp = -(-k // max(multiple, p)) * max(multiple, p)
            if -(-n // bn) * bn * kpp == elements and (bn, kpp) not in found:
                found.append((bn, kpp))
    return found


def _matches(raw: torch.Tensor, weight: torch.Tensor, bn: int, kpp: int) -> bool:
    """Whether `raw` (the packed bytes as weight's dtype, flat) is `block_weight(weight, bn, kpp)`,
    bit for bit: block 0 first (a wrong guess fails there), then all of it, compared as strided
    views (2 GB/s on one core; making the blocked copy first measured 4x slower)."""
    n, k = weight.shape
    p, blocks = PAIR[weight.dtype], -(-n // bn)
    if blocks * bn != n or kpp != k:  # padding: compared as the zeros the layout holds there
        weight = torch.nn.functional.pad(weight, (0, kpp - k, 0, blocks * bn - n))
    # A (k, P) group is 4 bytes in both dtypes: compared as one int32.
    got = raw.view(torch.int32).view(blocks, kpp // p, bn).transpose(1, 2)
    want = weight.contiguous().view(torch.int32).view(blocks, bn, kpp // p)
    return torch.equal(got[:1], want[:1]) and torch.equal(got, want)


def onednn_blocked_view(packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """The contract's layout as a view of a oneDNN-packed weight's bytes (`packed`, from
    `torch.ops.mkldnn._reorder_linear_weight(weight, ...)`; the view keeps it alive), or None where
    the bytes are not `block_weight(weight, BN, KP * P)` for any (BN, KP) their size allows, or the
    C++ library is not loaded. Every byte is compared once: one pass over the weight at load (~2 GB/s
    on one core; the first block alone rules out a wrong layout)."""
    if weight.dtype not in PAIR or not getattr(packed, "is_mkldnn", False):
        return None
    if not cpu_extension.load():
        return None
    try:
        raw = torch.ops.llm_cpu.mkldnn_bytes(packed)
    except RuntimeError:  # a torch without mkldnn::data_ptr / _nbytes: no view, oneDNN serves
        return None
    size = weight.element_size()
    if raw.numel() % size:
        return None
    raw = raw.view(weight.dtype)
    n, k = weight.shape
    p = PAIR[weight.dtype]
    weight = weight.contiguous()
    for bn, kpp in _candidates(n, k, p, raw.numel()):
        if _matches(raw, weight, bn, kpp):
            return raw.view(-(-n // bn), kpp // p, bn, p)
    return None


def stream_read_cpu(tensors: list[torch.Tensor]) -> int:
    """Read every byte of each (contiguous CPU) tensor once with the C++ library's widest loads,
    split evenly over the threads; returns the wrapping sum of their 32-bit words (so the read
    cannot be skipped). Only where `cpu_extension.load()`."""
    return torch.ops.llm_cpu.stream_read(tensors)
