"""PEFT LoRA adapters from a local directory (`adapter_config.json` + `adapter_model.safetensors`),
checked against the base model once, at load.

Supported: plain LoRA on any of the Llama family's projections (q/k/v/o, gate/up/down; Phi-3's
checkpoint-fused qkv_proj / gate_up_proj whole) of any layer (the attention ones only on
mixtures of experts: their expert weights are refused), any rank up to `max_lora_rank` (per
module, so PEFT's `rank_pattern` works), scaling `lora_alpha / r` or `lora_alpha / sqrt(r)` with
`use_rslora`. Everything else is refused with a LoRALoadError naming the adapter and the reason:
pickle weights, another base architecture or shape, DoRA, trained biases, `modules_to_save`,
`alpha_pattern`, other modules (embeddings, lm_head).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from backend_lib.errors import InputError

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target (PEFT module names of the Llama family)."""
FUSED_PROJECTIONS = ("qkv_proj", "gate_up_proj")
"""Checkpoint-fused projections (Phi-3's), adapted whole: one A and one B over [q | k | v] or
[gate | up], the layout of the engine's fused matmuls."""
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn"}
_PARENT |= {"o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_PARENT |= {"qkv_proj": "self_attn", "gate_up_proj": "mlp"}
_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
_MLP_PART = re.compile(r"\.(mlp|block_sparse_moe)\.")
CONFIG_FILE, WEIGHTS_FILE, PICKLE_FILE = (
    "adapter_config.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)
# adapter_config.json settings this engine cannot honour, with the value that is harmless.
_UNSUPPORTED: dict[str, Any] = {
    "use_dora": False,
    "bias": "none",
    "lora_bias": False,
    "modules_to_save": None,
    "alpha_pattern": {},
    "fan_in_fan_out": False,
    "trainable_token_indices": None,
    "target_parameters": None,
    "layer_replication": None,
}


class LoRALoadError(InputError):
    """An adapter directory cannot be served (reaches the requesting client only)."""


@dataclass(frozen=True)
class LoRAModelSpec:
    """What an adapter must match: the base model's architecture and projection shapes."""

    architecture: str
    num_layers: int
    shapes: Mapping[str, tuple[int, int]]
    """Projection name -> (in_features, out_features)."""

    @classmethod
    def for_llama(
        cls,
        architecture: str,
        num_layers: int,
        hidden: int,
        intermediate: int,
        q_size: int,
        kv_size: int,
        mlp: bool = True,
    ) -> LoRAModelSpec:
        """`mlp` False: adapters may target the attention projections only (mixtures of experts,
        whose MLPs are experts)."""
        shapes = {"q_proj": (hidden, q_size), "k_proj": (hidden, kv_size)}
        shapes |= {"v_proj": (hidden, kv_size), "o_proj": (q_size, hidden)}
        shapes |= {"qkv_proj": (hidden, q_size + 2 * kv_size)}
        if mlp:
            shapes |= {"gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate)}
            shapes |= {"down_proj": (intermediate, hidden)}
            shapes |= {"gate_up_proj": (hidden, 2 * intermediate)}
        return cls(architecture, num_layers, shapes)


@dataclass(frozen=True)
class LoRAModule:
    """One adapted projection of one layer, in float32 on the host."""

    lora_a: torch.Tensor
    """[r, in_features]."""
    lora_b: torch.Tensor
    """[out_features, r], multiplied by the adapter's scaling."""

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass(frozen=True)
class LoRAAdapter:
    """A validated adapter: its modules keyed by (layer, projection)."""

    name: str
    path: Path
    modules: Mapping[tuple[int, str], LoRAModule]

    @property
    def rank(self) -> int:
        """Largest rank over its modules."""
        return max(m.rank for m in self.modules.values())

    @property
    def nbytes(self) -> int:
        return sum(m.lora_a.nbytes + m.lora_b.nbytes for m in self.modules.values())


def load_adapter(
    name: str, path: str | Path, spec: LoRAModelSpec, max_lora_rank: int
) -> LoRAAdapter:
    """Read and validate the PEFT adapter in directory `path`; LoRALoadError says what is wrong."""
    root = Path(path)

    def fail(reason: str) -> LoRALoadError:
        return LoRALoadError(f"LoRA adapter {name!r} ({root}) cannot be loaded: {reason}")

    if not root.is_dir():
        raise fail("no such directory")
    config = _read_config(root, fail)
    base = (config.get("auto_mapping") or {}).get("base_model_class")
    if base and base != spec.architecture:
        raise fail(f"it was trained on a {base}, the served model is a {spec.architecture}")
    weights = root / WEIGHTS_FILE
    if not weights.is_file():
        if (root / PICKLE_FILE).is_file():
            raise fail(f"only {PICKLE_FILE} found: pickle files are refused, use safetensors")
        raise fail(f"no {WEIGHTS_FILE}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise fail(f"lora_alpha must be a positive number, got {alpha!r}")
    rslora = bool(config.get("use_rslora", False))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open objects are not iterable)
                layer, module, which = _parse_name(key, spec, fail)
                pairs.setdefault((layer, module), {})[which] = f.get_tensor(key).float()
    except LoRALoadError:
        raise
    except Exception as exc:  # a truncated or foreign file
        raise fail(f"unreadable {WEIGHTS_FILE}: {exc}") from None
    if not pairs:
        raise fail(f"{WEIGHTS_FILE} holds no LoRA weights")
    modules = {}
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise fail(f"layer {layer} {module} has lora_{''.join(pair)} without its partner")
        a, b = pair["A"], pair["B"]
        in_features, out_features = spec.shapes[module]
        rank = a.shape[0]
        if (
            a.ndim != 2
            or b.ndim != 2
            or a.shape[1] != in_features
            or b.shape != (out_features, rank)
        ):
            raise fail(
                f"layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not "
                f"fit the base model's {module} ({in_features} -> {out_features}): "
                "an adapter for another base model?"
            )
        if rank > max_lora_rank:
            raise fail(
                f"rank {rank} (layer {layer} {module}) exceeds max_lora_rank={max_lora_rank}"
            )
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        modules[(layer, module)] = LoRAModule(a.contiguous(), (b * scaling).contiguous())
    return LoRAAdapter(name, root, modules)


def _read_config(root: Path, fail) -> dict[str, Any]:
    path = root / CONFIG_FILE
    if not path.is_file():
        raise fail(f"no {CONFIG_FILE}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise fail(f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise fail(f"{CONFIG_FILE} must hold a JSON object")
    if config.get("peft_type") != "LORA":
        raise fail(f"peft_type must be LORA, got {config.get('peft_type')!r}")
    for key, harmless in _UNSUPPORTED.items():
        value = config.get(key, harmless)
        if value not in (harmless, None, {}, [], False):
            raise fail(f"{key}={value!r} is not supported")
    return config


def _parse_name(key: str, spec: LoRAModelSpec, fail) -> tuple[int, str, str]:
    if "gate_proj" not in spec.shapes and _MLP_PART.search(key):
        raise fail(
            f"tensor {key!r} adapts an MLP or expert weight: LoRA on this mixture-of-experts "
            f"model ({spec.architecture}) covers the attention projections only "
            f"({', '.join(spec.shapes)})"
        )
    match = _TENSOR_NAME.match(key)
    if match is None:
        raise fail(
            f"tensor {key!r} is not a LoRA weight of a supported module "
            f"({', '.join(PROJECTIONS + FUSED_PROJECTIONS)})"
        )
    layer, parent, module, which = int(match[1]), match[2], match[3], match[4]
    if _PARENT.get(module) != parent:
        raise fail(f"tensor {key!r}: unsupported module {parent}.{module}")
    if layer >= spec.num_layers:
        raise fail(f"tensor {key!r}: the base model has {spec.num_layers} layers")
    return layer, module, which
