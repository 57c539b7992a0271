"""Paged attention over a mixed batch of prefill chunks and decodes (KV read from the block cache).

Inputs (shared by the PyTorch and Triton paths):
  q [T, Hq, D]: new tokens of B sequences, flattened; sequence b owns rows
      query_start_loc[b]:query_start_loc[b+1] (query_start_loc [B+1] int32).
  seq_lens [B] int32: context length INCLUDING the new tokens; the new tokens of b sit at positions
      seq_lens[b]-q_len_b ... seq_lens[b]-1, everything before comes from the cache.
  k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] int32 maps
      logical block i of sequence b to a cache block (entries past ceil(seq_len/block_size) are never used).
The new tokens' K/V must already be in the cache (write_kv_cache first). Causal: position p attends keys
<= p, and > p - sliding_window when set. GQA: query head h reads kv head h // (Hq // Hkv).
visible_until [T] int32 (optional, keyword; rows as q): the last key position each new token
attends to, for spans attended both ways (a Gemma 3 image's tokens): a span's tokens get the
position of its last token, every other token its own (None: all their own, plain causal). Always
< seq_lens[b]: the caller keeps whole spans in a step's context (chunked prefill never ends a chunk
inside one), so a single new token's limit is its own position. The window still counts back from
the token's own position p: key k is visible iff k <= visible_until[t] and (no window or
k > p - sliding_window), as transformers' Gemma 3 masks (full layers: causal OR same image; sliding
layers: window AND (causal OR same image)).
softcap (Gemma's attention logit soft-capping), when set: each scaled score s becomes
tanh(s / softcap) * softcap before the softmax.
Cache slots outside every context must hold finite values (allocate the pool zeroed): the torch
decode path pads contexts with them and relies on 0 * value == 0.
8-bit caches (int8, float8_e4m3fn; kernels/kv_cache.py) come with k_scale, v_scale
[num_blocks, block_size, Hkv] float32, and a key or value row reads as its 8-bit row times its
scale. The C++ op and the Triton kernel read the 8-bit rows and scales in place (converted in
registers, the key scale applied to the scores, the value scale folded into the probabilities);
the PyTorch path dequantizes the context it gathers.

PyTorch path (CPU production, reference): single-token queries are grouped by context length (so
padding to a group's longest wastes little) and each group shares one batched gather and one masked
SDPA call, its GQA query heads folded into query rows; each longer chunk gets its own SDPA call with
a causal mask offset by its prefix, its upper bound visible_until in a chunk holding a span (the
plan marks those; decode groups need none: a single new token's limit is its own position). The
grouping (a `TorchAttentionPlan`) depends only on the batch metadata: the engine builds it once per
step and every layer reuses it.

C++ path (CPU production, `paged_attention_cpu`: the "torch" backend on CPU when
kernels/csrc/paged_attention_cpu.cpp is built, see kernels/cpu_extension.py): work items like the
Triton kernel's below, one query tile (up to 16 rows per kv head: tokens x the G heads sharing it)
per item, taking the tile's kv heads together chunk by chunk so each block's memory is read in order,
reading each key and value row straight from the cache through the block table (no gathered copy),
with an online softmax and accumulation in float32, in q's dtype out (float32, bfloat16, float16);
on a CPU with AVX512-BF16, bfloat16 scores and P @ V go through its dot product (P rounded to
bfloat16 for it, as GPU kernels do); items spread over torch's intra-op threads. The plan routes
each sequence: decodes and short chunks to the op, long chunks after a cached prefix to the SDPA
call above, whose GEMMs win there (`_native_takes` has the measured rule); the op is causal only,
so a sequence with a bidirectional span (visible_until) goes to SDPA too. Without the library (no
compiler at setup, another torch) everything goes through the PyTorch path.

Triton path: ONE unified kernel for prefill chunks and decodes alike, so a mixed batch is one launch.
A program owns one query tile of one sequence and one kv head: BLOCK_M rows = BLOCK_Q consecutive new
tokens x the G query heads sharing that kv head, so each K/V tile is loaded once per GQA group. It
walks the keys visible to the tile (causal or up to visible_until, optional sliding window)
BLOCK_N at a time, looking each key's cache block up in the block table (any block_size), with an
online softmax in float32 (exp2 domain: scale is pre-multiplied by log2 e). head_dim is padded to a
power of two with masks.
Tiles are numbered without a host sync: sequence b's tiles start at query_start_loc[b] // BLOCK_Q + b,
an upper bound on the tiles before it, so the grid is T // BLOCK_Q + B tiles; a program finds its
sequence by binary search and spare programs exit at once.
Split-KV (flash decoding): when the tiles cannot fill the GPU and contexts may be long, a third grid
axis splits each tile's key range into NUM_SPLITS parts. Each part writes its normalised partial
output and log-sum-exp to float32 scratch; `_merge_splits_kernel` combines them. The split count is
chosen from shapes only (block-table width), never from device data.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import cpu_extension
from kernels.kv_cache import QUANTIZED_KV_DTYPES, byte_view, dequantize_kv


def _gather_context(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache[block_ids] with the block axis folded into tokens: [..., n_blocks * block_size, Hkv, D].
    block_ids must be in range (the plan clamps unused table entries)."""
    # index_select over the cache viewed as one row per block copies whole blocks (memcpy); plain
    # advanced indexing, cache[block_ids], is ~3x slower on CPU.
    rows = byte_view(cache).view(cache.shape[0], -1).index_select(0, block_ids.reshape(-1))
    rows = rows.view(cache.dtype)
    return rows.view(*block_ids.shape[:-1], block_ids.shape[-1] * cache.shape[1], *cache.shape[2:])


def _gather_kv(
    cache: torch.Tensor, scale: torch.Tensor | None, block_ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The context of `block_ids` in `dtype` ([..., S, Hkv, D], `_gather_context`); an 8-bit
    cache's rows dequantized by their gathered scales."""
    rows = _gather_context(cache, block_ids)
    if scale is None:
        return rows.to(dtype)
    return dequantize_kv(rows, _gather_context(scale, block_ids), dtype)


def _length_groups(lengths: list[int], max_waste: float = 0.125) -> list[list[int]]:
    """Indices of `lengths` split into groups of similar length (sorted), so that padding every
    member to its group's longest wastes at most about `max_waste` of the group's keys. One padded
    batch over all decodes would pay for the longest context in every row."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
    groups: list[list[int]] = []
    for index in order:
        if groups and lengths[index] >= (1.0 - max_waste) * lengths[groups[-1][0]]:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


@dataclass
class _DecodeGroup:
    """Single-token queries of similar context length, attended as one padded batch."""

    rows: torch.Tensor | slice  # their rows in q / out (a slice when consecutive: no copies)
    block_ids: torch.Tensor  # [n, blocks]: cache blocks covering the group's longest context
    last_pos: torch.Tensor  # [n, 1] int64: position of each sequence's new token


@dataclass
class _Prefill:
    """A chunk of more than one new token: rows start:end of q, context_len keys in `block_ids`."""

    start: int
    end: int
    context_len: int
    block_ids: torch.Tensor
    limited: bool = False
    """It holds a bidirectional span: masked by visible_until (other chunks stay causal)."""


@dataclass
class TorchAttentionPlan:
    """How `paged_attention_torch` splits one batch into SDPA calls. It depends only on the batch
    metadata, so the runner builds it once per step and every layer reuses it (building it per
    layer cost ~5% of a decode step: a host copy, grouping, a dozen small index ops)."""

    decode_groups: list[_DecodeGroup]
    prefills: list[_Prefill]
    block_size: int
    native_seqs: torch.Tensor | None = None
    """int32 indices of the sequences left to the C++ op (`paged_attention_cpu`); None: none."""
    limits: bool = False
    """Built with `visible_until`: no sequence with a bidirectional span is in `native_seqs`."""
    _masks: dict[int | None, list[torch.Tensor]] = field(default_factory=dict)

    def decode_masks(self, sliding_window: int | None) -> list[torch.Tensor]:
        """Per decode group, [n, 1, 1, keys] bool: keys the new token sees (hides padding and,
        with a window, keys older than it). Built on first use per window."""
        if sliding_window not in self._masks:
            masks = []
            for group in self.decode_groups:
                key_pos = torch.arange(
                    group.block_ids.shape[1] * self.block_size, device=group.last_pos.device
                )
                visible = key_pos[None, :] <= group.last_pos
                if sliding_window is not None:
                    visible &= key_pos[None, :] > group.last_pos - sliding_window
                masks.append(visible[:, None, None, :])
            self._masks[sliding_window] = masks
        return self._masks[sliding_window]


def plan_paged_attention_torch(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    k_cache: torch.Tensor,
    *,
    native: bool = False,
    visible_until: torch.Tensor | None = None,
) -> TorchAttentionPlan:
    """The SDPA calls of `paged_attention_torch` for this batch (arguments as there; any layer's
    k_cache, for its shape): decodes in groups of similar context length, every longer chunk alone.
    `native`: the sequences `_native_takes` are left out, listed in `native_seqs` for the C++ op,
    except those with a bidirectional span in `visible_until` (the op is causal; one host copy).
    Raises ValueError for a single new token whose limit is not its own position."""
    num_seqs = seq_lens.shape[0]
    num_blocks, block_size = k_cache.shape[:2]
    # One host copy of the metadata: grouping needs plain ints.
    host = torch.cat((query_start_loc, seq_lens)).tolist()
    starts, context_lens = host[: num_seqs + 1], host[num_seqs + 1 :]
    device = block_tables.device

    query_lens = [starts[b + 1] - starts[b] for b in range(num_seqs)]
    to_op = [b for b in range(num_seqs) if native and _native_takes(query_lens[b], context_lens[b])]
    spans: set[int] = set()
    if visible_until is not None:
        spans = _bidirectional_seqs(visible_until, starts, context_lens)
        if any(query_lens[b] == 1 for b in spans):
            raise ValueError("visible_until: a single new token sees up to its own position only")
        to_op = [b for b in to_op if b not in spans]
    own = sorted(set(range(num_seqs)).difference(to_op))
    # Unused table entries may hold -1 or stale ids; clamping keeps gathers in range (the masks
    # discard those keys). Only the sequences SDPA runs read them.
    tables = block_tables.clamp(0, num_blocks - 1).long() if own else block_tables
    decode_seqs = [b for b in own if query_lens[b] == 1]
    groups = []
    for members in _length_groups([context_lens[b] for b in decode_seqs]):
        seqs = [decode_seqs[i] for i in members]
        longest = context_lens[seqs[0]]  # groups are sorted longest first
        index = torch.tensor(seqs, device=device)
        rows = [starts[b] for b in seqs]
        consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
        groups.append(
            _DecodeGroup(
                rows=slice(rows[0], rows[0] + len(rows))
                if consecutive
                else torch.tensor(rows, device=device),
                block_ids=tables[index, : triton.cdiv(longest, block_size)],
                last_pos=torch.tensor([context_lens[b] - 1 for b in seqs], device=device)[:, None],
            )
        )
    prefills = [
        _Prefill(
            starts[b],
            starts[b + 1],
            context_lens[b],
            tables[b, : triton.cdiv(context_lens[b], block_size)],
            b in spans,
        )
        for b in own
        if query_lens[b] > 1
    ]
    native_seqs = torch.tensor(to_op, dtype=torch.int32) if native else None
    return TorchAttentionPlan(
        groups, prefills, block_size, native_seqs, limits=visible_until is not None
    )


def _bidirectional_seqs(
    visible_until: torch.Tensor, starts: list[int], context_lens: list[int]
) -> set[int]:
    """The sequences with a new token whose `visible_until` is not its own position (one host
    copy); starts, context_lens: query_start_loc and seq_lens as ints."""
    bounds = torch.tensor(starts)
    seqs = torch.arange(len(context_lens)).repeat_interleave(bounds.diff())
    # Row r of sequence b sits at position r + seq_lens[b] - query_start_loc[b + 1].
    offsets = torch.tensor(context_lens, dtype=torch.long) - bounds[1:]
    own = torch.arange(starts[-1]) + offsets[seqs]
    return set(seqs[visible_until[: starts[-1]].cpu() != own].tolist())


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """SDPA of q [B, Hq, L, D] over k, v [B, Hkv, S, D] (Hq a multiple of Hkv) with a boolean
    `mask` broadcast to [B, Hq, L, S] (None: causal, L == S). With `softcap` (which SDPA cannot
    apply) the scores are formed explicitly, in float32, capped, masked and softmaxed."""
    groups = q.shape[1] // k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=groups != 1
        )
    if groups != 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v.float()).to(q.dtype)


def _decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Single-token queries q [N, Hq, D], one per sequence: one batched gather of the contexts
    (blocks `block_ids` [N, blocks]), then one SDPA call masked by `visible` [N, 1, 1, keys]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    keys = _gather_kv(k_cache, k_scale, block_ids, q.dtype)  # [N, S, Hkv, D]
    values = _gather_kv(v_cache, v_scale, block_ids, q.dtype)
    # The G query heads sharing a kv head act as G query rows of that head (all at the same
    # position, so one mask row serves them): SDPA then reads each key once per kv head with a
    # G-row matmul instead of once per query head with a vector product (1.5x faster on CPU).
    out = _sdpa(
        q.reshape(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim),
        keys.transpose(1, 2),  # [N, Hkv, S, D], a strided view: no copy
        values.transpose(1, 2),
        visible,
        scale,
        softcap,
    )
    return out.reshape(num_tokens, num_heads, head_dim)


def _prefill_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    context_len: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    visible_until: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence's chunk q [L, Hq, D] whose last token is at position context_len - 1;
    visible_until [L] int: each token's last visible key position (None: its own)."""
    query_len = q.shape[0]
    keys = _gather_kv(k_cache, k_scale, block_ids, q.dtype)[:context_len]  # [S, Hkv, D]
    values = _gather_kv(v_cache, v_scale, block_ids, q.dtype)[:context_len]

    mask = None
    if sliding_window is not None or query_len != context_len or visible_until is not None:
        # Causal mask offset by the cached prefix: query i sits at position context_len - L + i.
        query_pos = torch.arange(context_len - query_len, context_len, device=q.device)[:, None]
        key_pos = torch.arange(context_len, device=q.device)[None, :]
        mask = key_pos <= (query_pos if visible_until is None else visible_until[:, None])
        if sliding_window is not None:
            mask &= key_pos > query_pos - sliding_window
    out = _sdpa(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        mask,
        scale,
        softcap,
    )
    return out[0].transpose(0, 1)


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    plan: TorchAttentionPlan | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    visible_until: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the new tokens q [T, Hq, D] over their cached context; returns out [T, Hq, D]
    in q's dtype (written into `out` when given). The engine's CPU path: single-token queries in
    groups of similar context length, one batched gather + masked SDPA per group; every longer chunk
    through its own SDPA call with a causal mask offset by its cached prefix. `plan`: this batch's
    `plan_paged_attention_torch` (built here when not given); rows it leaves to the C++ op
    (`native_seqs`) are not written. k_scale, v_scale: an 8-bit cache's scales; visible_until [T]
    int32: each token's last visible key (module docstring; decode groups take their own position,
    the only one the contract allows a single new token: a plan built with visible_until checks)."""
    _check_cache_scales(k_cache, k_scale, v_scale)
    if out is None:
        out = torch.empty_like(q)
    if plan is None:
        plan = plan_paged_attention_torch(
            query_start_loc, seq_lens, block_tables, k_cache, visible_until=visible_until
        )
    _check_plan_limits(plan, visible_until)
    for group, visible in zip(plan.decode_groups, plan.decode_masks(sliding_window), strict=True):
        out[group.rows] = _decode_attention_torch(
            q[group.rows],
            k_cache,
            v_cache,
            group.block_ids,
            visible,
            scale,
            softcap,
            k_scale,
            v_scale,
        ).to(out.dtype)
    for chunk in plan.prefills:
        rows = slice(chunk.start, chunk.end)
        out[rows] = _prefill_attention_torch(
            q[rows],
            k_cache,
            v_cache,
            chunk.block_ids,
            chunk.context_len,
            scale,
            sliding_window,
            softcap,
            k_scale,
            v_scale,
            visible_until[rows] if chunk.limited else None,
        ).to(out.dtype)
    return out


def _check_plan_limits(plan: TorchAttentionPlan, visible_until: torch.Tensor | None) -> None:
    """A plan used with visible_until must have been built with it: only then are its span
    chunks marked and kept from the C++ op (which is causal)."""
    if visible_until is not None and not plan.limits:
        raise ValueError("visible_until needs a plan built with it (plan_paged_attention_*)")


def _check_cache_scales(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> None:
    """8-bit caches come with both scales, other caches with none."""
    quantized = k_cache.dtype in QUANTIZED_KV_DTYPES
    if quantized != (k_scale is not None) or quantized != (v_scale is not None):
        raise ValueError(
            f"a {k_cache.dtype} cache takes {'k_scale and v_scale' if quantized else 'no scales'}"
        )


# C++ path (design in the module docstring; the op in kernels/csrc/paged_attention_cpu.cpp).

NATIVE_MAX_QUERY_LEN = 16
NATIVE_MAX_FRESH_LEN = 512


def _native_takes(query_len: int, context_len: int) -> bool:
    """Whether the C++ op beats SDPA on a chunk (measured, 1 thread, 8 Hq / 2 Hkv, D 64; module
    docstring). The op costs about 1.75x SDPA's GEMMs per (query, visible key) pair but skips the keys
    the causal mask hides, where one SDPA call pays the whole query x context rectangle plus ~0.8 ms of
    mask set-up. So: every chunk of up to NATIVE_MAX_QUERY_LEN tokens (break-even at 16 after a
    768-token prefix), and chunks with little cached prefix (at most a quarter of the chunk) up to
    NATIVE_MAX_FRESH_LEN tokens (1.2x faster at 512, 0.85x at 1024)."""
    if query_len <= NATIVE_MAX_QUERY_LEN:
        return True
    return query_len <= NATIVE_MAX_FRESH_LEN and 4 * (context_len - query_len) <= query_len


def _native_usable(k_cache: torch.Tensor) -> bool:
    if k_cache.dtype in QUANTIZED_KV_DTYPES:  # the op reads 8-bit caches in place
        return k_cache.stride(-1) == 1 and k_cache.is_cpu and cpu_extension.load()
    return k_cache.stride(-1) == 1 and cpu_extension.takes(k_cache)


def plan_paged_attention_cpu(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    k_cache: torch.Tensor,
    *,
    visible_until: torch.Tensor | None = None,
) -> TorchAttentionPlan:
    """The plan of `paged_attention_cpu`: the chunks `_native_takes` to the C++ op when it is loaded
    and the cache is a CPU one of a dtype it handles (but no sequence with a bidirectional span in
    `visible_until`), the rest as `plan_paged_attention_torch` splits them."""
    return plan_paged_attention_torch(
        query_start_loc,
        seq_lens,
        block_tables,
        k_cache,
        native=_native_usable(k_cache),
        visible_until=visible_until,
    )


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    plan: TorchAttentionPlan | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    visible_until: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention_torch`'s contract, the "torch" backend's entry: the C++ op for the rows the
    plan (`plan_paged_attention_cpu`, built here when not given; with visible_until, built with it
    too) leaves to it, SDPA for the rest."""
    if out is None:
        out = torch.empty_like(q)
    if plan is None:
        plan = plan_paged_attention_cpu(
            query_start_loc, seq_lens, block_tables, k_cache, visible_until=visible_until
        )
    _check_plan_limits(plan, visible_until)
    if plan.native_seqs is not None:
        tensors = (q, k_cache, v_cache, out)
        scales = () if k_scale is None else (k_scale, v_scale)
        cache_dtype = k_cache.dtype if k_scale is not None else q.dtype  # 8-bit: with scales
        if (
            all(t.stride(-1) == 1 for t in tensors)
            and out.dtype == q.dtype
            and k_cache.dtype == v_cache.dtype == cache_dtype
        ):
            torch.ops.llm_cpu.paged_attention(
                q,
                k_cache,
                v_cache,
                query_start_loc.to(torch.int32).contiguous(),
                seq_lens.to(torch.int32).contiguous(),
                block_tables.to(torch.int32).contiguous(),
                scale,
                sliding_window or 0,
                plan.native_seqs,
                out,
                **({"softcap": softcap} if softcap else {}),
                **({"k_scale": k_scale, "v_scale": v_scale} if scales else {}),
            )
        else:  # a layout the op does not take (mixed dtypes): all through PyTorch
            plan = plan_paged_attention_torch(
                query_start_loc, seq_lens, block_tables, k_cache, visible_until=visible_until
            )
    return paged_attention_torch(
        q,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        scale,
        sliding_window,
        out,
        plan=plan,
        softcap=softcap,
        k_scale=k_scale,
        v_scale=v_scale,
        visible_until=visible_until,
    )


# Triton path (design in the module docstring).

_LOG2_E = 1.4426950408889634


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Largest b with query_start_loc[b] // BLOCK_Q + b <= tile (binary search)."""
    lo = 0
    hi = num_seqs
    while lo < hi - 1:
        mid = (lo + hi) // 2
        mid_start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(mid_start <= tile, mid, lo)
        hi = tl.where(mid_start <= tile, hi, mid)
    return lo


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    qk_scale,
    softcap,
    num_seqs,
    num_heads,
    head_dim,
    sliding_window,
    stride_q_t,
    stride_q_h,
    stride_out_t,
    stride_out_h,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_block_table,
    k_scale_ptr,
    v_scale_ptr,
    stride_scale_block,
    stride_scale_token,
    stride_scale_head,
    visible_until_ptr,
    NUM_GROUPS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr = False,
    FP8: tl.constexpr = False,
    HAS_LIMITS: tl.constexpr = False,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    context_len = tl.load(seq_lens_ptr + seq)
    first_pos = context_len - q_len  # position of the sequence's first new token

    # Rows: token-major, the G heads of this kv head inner.
    rows = tl.arange(0, BLOCK_M)
    token = q_tile * BLOCK_Q + rows // NUM_GROUPS  # index among the sequence's new tokens
    head = kv_head * NUM_GROUPS + rows % NUM_GROUPS
    row_valid = (rows < BLOCK_Q * NUM_GROUPS) & (token < q_len)
    query_pos = first_pos + token
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim
    row_offset = (q_start + token).to(tl.int64)
    q = tl.load(
        q_ptr + row_offset[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )

    # Keys visible to any row of the tile, then this split's share of them.
    kv_end = first_pos + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len)
    last_key = query_pos  # each row's last visible key
    if HAS_LIMITS:
        last_key = tl.load(visible_until_ptr + row_offset, mask=row_valid, other=0)
        last_key = tl.where(row_valid, last_key, query_pos)
        # Clamped to the context: a limit past it (against the contract) reads no stray block.
        kv_end = tl.minimum(tl.max(tl.where(row_valid, last_key + 1, 0), axis=0), context_len)
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(first_pos + q_tile * BLOCK_Q - sliding_window + 1, 0)
    if NUM_SPLITS > 1:
        span = tl.cdiv(tl.cdiv(kv_end - kv_begin, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_begin = kv_begin + split * span
        kv_end = tl.minimum(kv_end, kv_begin + span)

    # Finite start for the running max: a row with no visible key in a tile then gives
    # exp2(-inf - m) = 0 instead of NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    for tile_start in range(kv_begin, kv_end, BLOCK_N):
        key_pos = tile_start + tl.arange(0, BLOCK_N)
        key_valid = key_pos < kv_end
        block_id = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        kv_offset = (
            block_id * stride_cache_block
            + (key_pos % BLOCK_SIZE) * stride_cache_token
            + kv_head * stride_cache_head
        )
        k = tl.load(
            k_cache_ptr + kv_offset[None, :] + dims[:, None],
            mask=key_valid[None, :] & dim_valid[:, None],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        if QUANTIZED:
            # 8-bit rows to q's dtype (exact: int8 and e4m3 values fit fp16/bf16), the key's scale
            # on its scores.
            scale_offset = (
                block_id * stride_scale_block
                + (key_pos % BLOCK_SIZE) * stride_scale_token
                + kv_head * stride_scale_head
            )
            k_scale = tl.load(k_scale_ptr + scale_offset, mask=key_valid, other=0.0)
            scores = tl.dot(q, _dequantized(k, FP8, q.dtype), input_precision=DOT_PRECISION)
            scores = scores * k_scale[None, :] * qk_scale
        else:
            scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if USE_SOFTCAP:
            # qk_scale is the plain scale here: cap, then into the exp2 domain.
            # tanh(y) = 2 sigmoid(2y) - 1 (no tanh in every backend).
            capped = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
            scores = capped * 1.4426950408889634
        visible = key_valid[None, :] & (key_pos[None, :] <= last_key[:, None])
        if USE_WINDOW:
            visible = visible & (key_pos[None, :] > query_pos[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_cache_ptr + kv_offset[:, None] + dims[None, :],
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        if QUANTIZED:  # the value's scale into its probabilities (l_i has the true sums)
            v_scale = tl.load(v_scale_ptr + scale_offset, mask=key_valid, other=0.0)
            p = p * v_scale[None, :]
            v = _dequantized(v, FP8, q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Rows that saw no key (only possible in a split or a spare row) have l = 0 and acc = 0.
    has_keys = l_i > 0.0
    result = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    store_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS == 1:
        out_offset = (
            row_offset[:, None] * stride_out_t + head[:, None] * stride_out_h + dims[None, :]
        )
        tl.store(out_ptr + out_offset, result.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        part = (row_offset * num_heads + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * head_dim + dims[None, :], result, mask=store_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_valid)


@triton.jit
def _dequantized(x, FP8: tl.constexpr, dtype: tl.constexpr):
    """8-bit cache rows (int8, or float8_e4m3fn as their bytes) in `dtype`, unscaled."""
    if FP8:
        return x.to(tl.float8e4nv, bitcast=True).to(dtype)
    return x.to(dtype)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_out_t,
    stride_out_h,
    num_heads,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # out = sum_s w_s * o_s / sum_s w_s with w_s = 2^(lse_s - max lse); empty splits have lse -inf.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    part = (token * num_heads + head) * NUM_SPLITS + splits
    lse = tl.load(part_lse_ptr + part, mask=splits < NUM_SPLITS, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, axis=0))
    partial = tl.load(
        part_out_ptr + part[:, None] * head_dim + dims[None, :],
        mask=(splits[:, None] < NUM_SPLITS) & (dims[None, :] < head_dim),
        other=0.0,
    )
    result = tl.sum(partial * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(
        out_ptr + token * stride_out_t + head * stride_out_h + dims,
        result.to(out_ptr.dtype.element_ty),
        mask=dims < head_dim,
    )


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of `_paged_attention_kernel` (see the module docstring)."""

    block_m: int  # rows per program: block_q tokens x the GQA group
    block_q: int
    block_n: int  # keys per inner step
    num_warps: int


def tile_config(
    num_tokens: int,
    num_seqs: int,
    groups: int,
    dtype: torch.dtype,
    head_dim: int = 128,
    quantized: bool = False,
) -> TileConfig:
    """Tiles from shapes only. Sizes keep the H100 build free of register spills at head_dim <= 128:
    the per-key block lookup makes K/V loads gathers, one 64-bit address per element. Wider heads
    (Gemma's 256) and 8-bit caches (`quantized`: the dequantized rows and their scales) take
    prefill tiles of 32 rows on 8 warps (64 rows spilled 400+ bytes at head_dim 256 and 88 bytes
    with an int8 cache on sm_90)."""
    all_decodes = num_tokens == num_seqs  # one new token per sequence: small row tiles
    wide = (head_dim > 128 or quantized) and not all_decodes
    block_m = max(16 if all_decodes else 32 if wide else 64, triton.next_power_of_2(groups))
    # fp32 dots run as IEEE FMAs (not tensor cores) and need more threads to hold their tiles.
    num_warps = 8 if dtype == torch.float32 or wide else 4
    return TileConfig(block_m, block_m // groups, 32, num_warps)


@functools.lru_cache
def _multiprocessor_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _default_num_splits(num_programs: int, max_context: int, device: torch.device) -> int:
    """Split the keys only when the tiles alone cannot fill the GPU and contexts may be long.
    Decided from shapes (max_context = block-table width x block size), never from device data."""
    if device.type != "cuda" or max_context < 1024:
        return 1
    free_slots = 2 * _multiprocessor_count(device)
    if num_programs >= free_slots:
        return 1
    return max(1, min(triton.cdiv(free_slots, num_programs), max_context // 512, 32))


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    num_kv_splits: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    visible_until: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of `paged_attention_torch` (same contract, visible_until included).
    `num_kv_splits` forces the split-KV path (>1) or turns it off (1); by default it is chosen from
    the shapes. No host sync."""
    _check_cache_scales(k_cache, k_scale, v_scale)
    quantized = k_scale is not None
    if quantized and k_scale.stride() != v_scale.stride():
        raise ValueError("k_scale and v_scale must share strides")
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides with a unit-stride head_dim")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out

    groups = num_heads // num_kv_heads
    tiles = tile_config(num_tokens, num_seqs, groups, q.dtype, head_dim, quantized)
    num_tiles = num_tokens // tiles.block_q + num_seqs
    num_splits = num_kv_splits or _default_num_splits(
        num_tiles * num_kv_heads, block_tables.shape[1] * block_size, q.device
    )
    block_d = triton.next_power_of_2(head_dim)

    part_out = part_lse = out  # unused placeholders when not splitting
    if num_splits > 1:
        part_out = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device
        )

    # The 8-bit and limited variants only where asked: the plain launch stays what it was.
    variants = {}
    scale_strides = (0, 0, 0)
    if quantized:
        variants = {"QUANTIZED": True, "FP8": k_cache.dtype == torch.float8_e4m3fn}
        scale_strides = k_scale.stride()
    if visible_until is not None:
        variants["HAS_LIMITS"] = True
        visible_until = visible_until.contiguous()
    _paged_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        q,
        byte_view(k_cache),  # float8 as its bytes (the kernel bitcasts them)
        byte_view(v_cache),
        out,
        part_out,
        part_lse,
        query_start_loc,
        seq_lens,
        block_tables,
        scale if softcap else scale * _LOG2_E,
        softcap or 0.0,
        num_seqs,
        num_heads,
        head_dim,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        k_scale if quantized else out,  # placeholders when not quantized
        v_scale if quantized else out,
        *scale_strides,
        out if visible_until is None else visible_until,  # a placeholder without limits
        NUM_GROUPS=groups,
        BLOCK_SIZE=block_size,
        BLOCK_M=tiles.block_m,
        BLOCK_Q=tiles.block_q,
        BLOCK_N=tiles.block_n,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=bool(softcap),
        # fp32 inputs would otherwise go through TF32 on Ampere+ (10-bit mantissa).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps,
        **variants,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            head_dim,
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )
    return out
