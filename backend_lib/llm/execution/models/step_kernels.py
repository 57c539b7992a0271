"""How one forward step calls its kernels: the Llama forward (models/llama.py) is written once over
this interface, and picks one binding per step.

- `CppKernels`: straight calls of the C++ ops (kernels/csrc/) into preallocated outputs, the
  step's metadata converted once. The kernel-op wrappers' checks and conversions cost ~75 us of
  Python per layer (~0.6 ms per step on an 8-layer model, not shrinking with threads); these skip
  them. For steps the C++ ops serve entirely (`serves`) on a model bound for them.
- `OpsKernels`: the `KernelOps` wrappers (Triton kernels, the PyTorch twins, the CPU attention
  plan's SDPA chunks); every other step.

On a step both serve they make the same op calls on the same tensors: the same bits (tested).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from backend_lib.llm.execution.attention import AttentionMetadata, KVCache
from backend_lib.llm.execution.models.decode_layers import DecodeLayers
from kernels import KernelOps


@dataclass(frozen=True, slots=True)
class CppOps:
    """The C++ library's ops (`torch.ops.llm_cpu.*`), looked up once."""

    rms_norm: Callable[..., None]
    rotary: Callable[..., None]
    write_kv_cache: Callable[..., None]
    paged_attention: Callable[..., None]
    silu_and_mul: Callable[..., None]
    gelu_tanh_and_mul: Callable[..., None]
    decode_layers: Callable[..., torch.Tensor]

    @classmethod
    def load(cls) -> CppOps:
        """The loaded library's ops (`kernels.cpu_extension.load()` must have returned True)."""
        ops = torch.ops.llm_cpu
        return cls(
            ops.rms_norm.default,
            ops.rotary.default,
            ops.write_kv_cache.default,
            ops.paged_attention.default,
            ops.silu_and_mul.default,
            ops.gelu_tanh_and_mul.default,
            ops.decode_layers.default,
        )


class CppKernels:
    """One step's kernels as straight C++ op calls (module docstring)."""

    __slots__ = (
        "_ops",
        "_eps",
        "_positions",
        "_rope",
        "_slots",
        "_starts",
        "_lens",
        "_tables",
        "_seqs",
    )

    def __init__(
        self,
        ops: CppOps,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        rope_cache: torch.Tensor,
        eps: float,
    ):
        self._ops, self._eps, self._rope = ops, eps, rope_cache
        # The dtypes and layouts the ops take, once per step instead of once per layer.
        self._positions = positions.long().contiguous()
        self._slots = meta.slot_mapping.long().contiguous()
        self._starts = meta.query_start_loc.to(torch.int32).contiguous()
        self._lens = meta.seq_lens.to(torch.int32).contiguous()
        self._tables = meta.block_tables.to(torch.int32).contiguous()
        self._seqs = meta.plan.native_seqs

    @staticmethod
    def serves(meta: AttentionMetadata) -> bool:
        """Whether the attention plan (the "torch" kernels' `TorchAttentionPlan`) leaves every
        sequence of the step to the C++ op (no SDPA decode group or chunk)."""
        plan = meta.plan
        return (
            plan is not None
            and meta.visible_until is None  # the op is causal only
            and plan.native_seqs is not None
            and not plan.decode_groups
            and not plan.prefills
        )

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm of x (+ residual), the new residual: x + residual, or x itself without one);
        x [N, dim], unit stride along dim."""
        out = torch.empty_like(x)
        if residual is None:
            self._ops.rms_norm(x, weight, self._eps, None, out, out)
            return out, x
        summed = torch.empty_like(x)
        self._ops.rms_norm(x, weight, self._eps, residual, out, summed)
        return out, summed

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """New rotated q [T, Hq, D] and k [T, Hkv, D] (contiguous) at the step's positions, by
        `cache` (a layer's own cos/sin table, e.g. Gemma 3's local one; None: the model's)."""
        q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
        k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
        rope = self._rope if cache is None else cache
        self._ops.rotary(self._positions, q, k, rope, q_out, k_out)
        return q_out, k_out

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Write k, v [T, Hkv, D] into the cache, then attend q [T, Hq, D] over it -> [T, Hq, D];
        `softcap`: Gemma's attention logit soft-capping (None: none). An 8-bit cache's scales
        (kv_cache[2:]) go to both ops."""
        k_cache, v_cache, *scales = kv_cache
        self._ops.write_kv_cache(k, v, k_cache, v_cache, self._slots, *scales)
        out = torch.empty_like(q)
        self._ops.paged_attention(
            q,
            k_cache,
            v_cache,
            self._starts,
            self._lens,
            self._tables,
            scale,
            sliding_window or 0,  # the op's "none"
            self._seqs,
            out,
            softcap or 0.0,
            *scales,
        )
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[N, 2I] -> silu(gate) * up [N, I]."""
        out = x.new_empty((x.shape[0], x.shape[1] // 2))
        self._ops.silu_and_mul(x, out)
        return out

    def decode_layers(
        self,
        layers: DecodeLayers,
        hidden: torch.Tensor,
        kv_caches: Sequence[KVCache],
        output_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """Every decoder layer and the final norm on the embedded rows `hidden` in one C++ call
        (models/decode_layers.py): the final-normed states of `output_rows` (all rows for None)."""
        return self._ops.decode_layers(
            hidden,
            layers.weights,
            layers.biases,
            layers.projections,
            [tensor for kv in kv_caches for tensor in kv],
            self._positions,
            self._slots,
            self._starts,
            self._lens,
            self._tables,
            self._seqs,
            self._rope,
            self._eps,
            layers.scales,
            layers.sliding_windows,
            layers.num_heads,
            layers.num_kv_heads,
            layers.head_dim,
            layers.final_norm,
            output_rows,
        )

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[N, 2I] -> gelu_tanh(gate) * up [N, I] (Gemma)."""
        out = x.new_empty((x.shape[0], x.shape[1] // 2))
        self._ops.gelu_tanh_and_mul(x, out)
        return out


class OpsKernels:
    """One step's kernels through the `KernelOps` wrappers; `CppKernels`' interface."""

    __slots__ = ("_ops", "_eps", "_positions", "_rope", "_meta", "_plan")

    def __init__(
        self,
        ops: KernelOps,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        rope_cache: torch.Tensor,
        eps: float,
    ):
        self._ops, self._eps, self._positions, self._rope = ops, eps, positions, rope_cache
        self._meta = meta
        # Backends without a plan take no `plan=` argument.
        self._plan = {} if meta.plan is None else {"plan": meta.plan}

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._ops.rms_norm(x, weight, self._eps), x
        return self._ops.rms_norm(x, weight, self._eps, residual)

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rope = self._rope if cache is None else cache
        return self._ops.apply_rotary(self._positions, q, k, rope)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache, *scales = kv_cache
        meta = self._meta
        self._ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, *scales)
        # An 8-bit cache's scales, only then: bit-for-bit the same calls otherwise.
        scale_kw = {"k_scale": scales[0], "v_scale": scales[1]} if scales else {}
        return self._ops.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
            sliding_window=sliding_window,
            **self._plan,
            **({"softcap": softcap} if softcap else {}),
            **scale_kw,
            **({} if meta.visible_until is None else {"visible_until": meta.visible_until}),
        )

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.silu_and_mul(x)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.gelu_tanh_and_mul(x)


StepKernels = CppKernels | OpsKernels
"""What the forward calls its kernels through for one step."""
