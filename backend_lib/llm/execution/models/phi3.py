"""Phi-3 (Phi3ForCausalLM): the Llama forward (models/llama.py) with two differences.

- Its checkpoints store q/k/v and gate/up already fused, as `qkv_proj` and `gate_up_proj` in the
  layout of the fused parameters here ([q | k | v] and [gate | up] rows): each loads whole
  (`shards_of`), with no merging.
- Rope: `partial_rotary_factor` (only the leading dims of each head rotate) and LongRoPE
  ("longrope", "su"; Phi3Config also reads "yarn" as it), per-frequency short / long divisors
  and an attention factor scaling cos and sin (kernels/rotary.py `_longrope_inv_freq`). Which
  set applies: long for every position when the engine's max_model_len (the table's size)
  exceeds `original_max_position_embeddings`, else short: vLLM's static choice. transformers
  instead switches per forward by the sequence's length, which would leave keys cached under one
  set beside keys under the other; the two agree whenever a sequence stays within the original
  context and max_model_len does too.
- A `sliding_window` in its config applies to every layer (as transformers' Phi3Attention).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from backend_lib.llm.execution.models.llama import LlamaArgs, LlamaForCausalLM

_LONGROPE_NAMES = ("longrope", "su", "yarn")


def _phi3_rope_scaling(cfg: Mapping[str, Any], scaling: dict[str, Any] | None) -> dict | None:
    """`LlamaArgs`' rope scaling of a Phi-3 config, completed for kernels/rotary.py: "longrope"
    with `original_max_position_embeddings` (the config's top-level field first, as transformers)
    and `factor` (max_position_embeddings / original when the config gives none)."""
    if scaling is None:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type not in _LONGROPE_NAMES:
        raise ValueError(f"Phi-3 rope_type {rope_type!r} is not supported (expected longrope)")
    max_positions = cfg.get("max_position_embeddings", 4096)
    original = (
        cfg.get("original_max_position_embeddings")
        or scaling.get("original_max_position_embeddings")
        or max_positions
    )
    completed = dict(scaling, rope_type="longrope", original_max_position_embeddings=original)
    completed.setdefault("factor", max_positions / original)
    return completed


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 (module docstring)."""

    supports_tensor_parallel = False  # its own shapes are not sharded yet

    @classmethod
    def args_from_config(cls, cfg: Mapping[str, Any]) -> LlamaArgs:
        args = LlamaArgs.from_hf_config(cfg)
        scaling = _phi3_rope_scaling(cfg, args.rope_scaling)
        params = cfg.get("rope_parameters") or {}
        factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        rotary_dim = int(args.head_dim * factor)
        return replace(
            args,
            rope_scaling=scaling,
            rotary_dim=None if rotary_dim == args.head_dim else rotary_dim,
        )

    @staticmethod
    def shards_of(param_name: str) -> tuple[int | None, ...]:
        """Every parameter loads from one checkpoint tensor of its own name."""
        return (None,)
