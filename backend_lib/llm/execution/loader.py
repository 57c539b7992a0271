"""Read a local Hugging Face checkpoint directory and load it into a registered model class.

`read_checkpoint_info` is where the engine learns a checkpoint's facts (architecture, position
limit, EOS ids, weight files); `load_model` builds the model from them. Only local files, only
safetensors (pickle weights are refused: unpickling can run code), never remote code. Tensors go
straight from the file to the target device, then are cast into the preallocated parameters one
at a time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from safetensors import safe_open

from backend_lib.checkpoint import safetensors_files
from backend_lib.config import ConfigError
from backend_lib.linear import pack_linear_layers
from backend_lib.llm.execution.checkpoint_quantization import (
    CheckpointFormatError,
    CheckpointQuantization,
    read_checkpoint_quantization,
)
from backend_lib.llm.execution.checkpoint_quantization.layers import (
    finalize_quantized_layers,
    install_staging_layers,
    take_input_permutations,
)
from backend_lib.llm.execution.models import (
    MODEL_REGISTRY,
    decoder_config,
    resolve_model_class,
    supported_architectures,
)
from backend_lib.llm.execution.models.llama import DEFAULT_MAX_POSITION_EMBEDDINGS
from backend_lib.llm.execution.pipeline_parallel import NO_PIPELINE, PipelineStage
from backend_lib.llm.execution.tensor_parallel import NO_TENSOR_PARALLEL, TensorParallel
from backend_lib.quantization import quantize_linear_layers
from kernels import KernelOps


@dataclass(frozen=True)
class CheckpointInfo:
    """What the engine needs to know about a checkpoint directory, read once from its files."""

    model_dir: Path
    hf_config: Mapping[str, Any]
    """config.json as parsed (a read-only view)."""
    model_class: type[torch.nn.Module]
    """The registered model class for config.json's `architectures[0]`."""
    max_position_embeddings: int
    """Longest sequence (prompt plus output) the model was trained for, in tokens; config.json's
    value, 2048 when it has none."""
    eos_token_ids: tuple[int, ...]
    """Tokens that end generation: generation_config.json's eos_token_id, else config.json's;
    empty when neither has one."""
    weight_files: tuple[Path, ...]
    """The safetensors files holding the weights (see `backend_lib.checkpoint.safetensors_files`)."""
    quantization: CheckpointQuantization | None = None
    """How a pre-quantized checkpoint stores its layers (config.json's `quantization_config`);
    None for a full-precision one."""


def read_checkpoint_info(model_dir: str | Path) -> CheckpointInfo:
    """Read config.json, generation_config.json and the weight file names of `model_dir`.

    Raises ConfigError("model", ...) for a missing config.json, an unsupported architecture or
    missing (or only pickle) weights.
    """
    root = Path(model_dir)
    cfg = load_hf_config(root)
    try:
        quantization = read_checkpoint_quantization(cfg)
    except CheckpointFormatError as e:
        raise ConfigError("model", str(root), str(e)) from e
    model_class = model_class_for(cfg, root)
    decoder = decoder_config(model_class, cfg)
    return CheckpointInfo(
        model_dir=root,
        hf_config=MappingProxyType(cfg),
        model_class=model_class,
        max_position_embeddings=int(
            decoder.get("max_position_embeddings", DEFAULT_MAX_POSITION_EMBEDDINGS)
        ),
        eos_token_ids=_eos_token_ids(root, cfg),
        weight_files=tuple(safetensors_files(root)),
        quantization=quantization,
    )


def _eos_token_ids(model_dir: Path, hf_config: Mapping[str, Any]) -> tuple[int, ...]:
    """generation_config.json's eos_token_id, else config.json's (either an int or a list)."""
    eos = None
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        with open(gen_path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
    if eos is None:
        eos = hf_config.get("eos_token_id")
    if eos is None:
        return ()
    return (eos,) if isinstance(eos, int) else tuple(eos)


def load_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """The checkpoint's config.json as a dict."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError("model", str(model_dir), "no config.json in the checkpoint directory")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def model_class_for(cfg: Mapping[str, Any], model_dir: str | Path = "") -> type[torch.nn.Module]:
    """The registered class for `architectures[0]`; a clear error for anything else."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in MODEL_REGISTRY:
        raise ConfigError(
            "model",
            str(model_dir),
            f"unsupported architecture {arch!r}; supported: {', '.join(supported_architectures())}",
        )
    try:
        return resolve_model_class(arch, cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError("model", str(model_dir), f"bad config.json for {arch}: {e}") from e


def iter_safetensors(
    files: Iterable[Path], device: torch.device, keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file (those whose name `keep` accepts), each
    loaded directly onto `device`; a tensor not kept is never read."""
    for path in files:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open objects are not iterable)
                if keep is None or keep(name):
                    yield name, f.get_tensor(name)


def tensor_names(files: Iterable[Path]) -> Iterator[str]:
    """Every tensor name of every file (read from the headers; no tensor is loaded)."""
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            yield from f.keys()


QUANTIZE_LM_HEAD = True
"""Whether `quantization` covers the lm_head too (see README "Quantization" for the measurement
behind the choice)."""


def load_model(
    checkpoint: CheckpointInfo | str | Path,
    device: torch.device,
    dtype: torch.dtype,
    ops: KernelOps,
    max_position: int | None = None,
    pack_linear_weights: bool = True,
    quantization: str = "none",
    dynamic_int8: bool = False,
    quantize_lm_head: bool = QUANTIZE_LM_HEAD,
    tp: TensorParallel = NO_TENSOR_PARALLEL,
    pp: PipelineStage = NO_PIPELINE,
) -> torch.nn.Module:
    """Build the checkpoint's model on `device` in `dtype` and load its weights.

    `checkpoint` is a CheckpointInfo already read, or its directory. `max_position` sizes the
    rotary table (default: the checkpoint's max_position_embeddings). On CPU the projections'
    weights are then pre-packed for oneDNN (`backend_lib.linear`) unless `pack_linear_weights`
    is False. Last, the forward's calls are bound to the final weights (`bind_forward`).

    A pre-quantized checkpoint (`info.quantization`) loads as stored: its quantized projections
    are staged on the meta device, filled from the format's translated tensors and finalized into
    the layers that compute (checkpoint_quantization/layers.py); `dynamic_int8`: its 4-bit layers
    quantize their activations to int8 per call (the resolved `w4a16_activations` setting).

    `quantization` int8 or fp8 replaces the projections (q/k/v, o, gate/up, down; the lm_head
    too when `quantize_lm_head`) by `backend_lib.quantization.QuantizedLinear` layers, quantized
    from the loaded float weights, which are then freed; embeddings and norms stay in `dtype`.
    """
    info = as_checkpoint_info(checkpoint)
    model = load_checkpoint_weights(info, device, dtype, ops, max_position, tp, pp)
    finalize_quantized_layers(model, dynamic_int8)
    quantize_linear_layers(model, quantization, skip=() if quantize_lm_head else ("lm_head",))
    if pack_linear_weights:
        pack_linear_layers(model)
    model.bind_forward()
    return model.eval()


def load_checkpoint_weights(
    info: CheckpointInfo,
    device: torch.device,
    dtype: torch.dtype,
    ops: KernelOps,
    max_position: int | None = None,
    tp: TensorParallel = NO_TENSOR_PARALLEL,
    pp: PipelineStage = NO_PIPELINE,
) -> torch.nn.Module:
    """The first half of `load_model`: the model built on `device` with the checkpoint's tensors
    loaded as stored (a pre-quantized checkpoint's layers still `StagingLinear`s); under tensor
    parallelism (`tp`), this rank's slices of them; under pipeline parallelism (`pp`), only its
    stage's tensors (the others are never read)."""
    args = check_parallelism(info, tp.size, pp.size)
    # Parameters start on the meta device (no memory, no random init), then get real storage.
    with torch.device("meta"):
        model = info.model_class(args, ops, device, max_position, tp, pp)
    model = model.to(dtype)
    held = None if pp.size == 1 else lambda name: pp.holds(name, args.num_layers)
    weights = iter_safetensors(info.weight_files, device, held)
    if info.quantization is not None:
        # A tied lm_head is the embedding, which stays in `dtype`.
        tied = ("lm_head",) if args.tie_word_embeddings else ()
        stored = info.quantization.stored_layers(tensor_names(info.weight_files))

        def scheme_for(layer: str):
            return info.quantization.scheme_for(layer) if layer in stored else None

        staged = install_staging_layers(model, scheme_for, skip=tied)
        if tp.size > 1:
            # The files hold whole layers: check and translate them against the whole model's
            # shapes; `load_weights` then takes this rank's slices of the staging tensors.
            with torch.device("meta"):
                whole = info.model_class(args, ops, device, max_position, NO_TENSOR_PARALLEL, pp)
            staged = install_staging_layers(whole, scheme_for, skip=tied)
            weights = _sharded_input_orders(info.quantization.translate(weights, staged), tp)
        else:
            weights = info.quantization.translate(weights, staged)
        weights = take_input_permutations(model, weights)
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty gives tied parameters separate storage
    model.load_weights(weights)
    return model


def _sharded_input_orders(
    weights: Iterable[tuple[str, torch.Tensor]], tp: TensorParallel
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` with the input orders (GPTQ act-order `.perm`) of row-parallel layers, whose
    inputs the ranks split, dropped where they are the identity; any other order cannot be split
    into contiguous input ranges (ConfigError naming tensor_parallel_size). Column-parallel
    layers see every input: their orders pass whole."""
    for name, tensor in weights:
        row_parallel = ".self_attn.o_proj." in name or ".mlp.down_proj." in name
        if not (row_parallel and name.endswith(".perm")):
            yield name, tensor
            continue
        if not torch.equal(tensor, torch.arange(len(tensor), device=tensor.device)):
            raise ConfigError(
                "tensor_parallel_size",
                tp.size,
                f"{name.removesuffix('.perm')} is quantized with act-order (GPTQ desc_act): its "
                "inputs are permuted, so the ranks cannot split them (use a checkpoint without "
                "desc_act, or tensor_parallel_size 1)",
            )


def _check_quantized_groups(info: CheckpointInfo, args, tp_size: int) -> None:
    """ConfigError naming tensor_parallel_size when a quantized row-parallel layer's groups
    straddle the ranks: each rank takes in_features / tp_size of its inputs, in whole groups."""
    stored = info.quantization.stored_layers(tensor_names(info.weight_files))
    widths = {"self_attn.o_proj": args.num_heads * args.head_dim}
    widths["mlp.down_proj"] = args.intermediate_size
    for layer in range(args.num_layers):
        for projection, in_features in widths.items():
            module = f"model.layers.{layer}.{projection}"
            scheme = info.quantization.scheme_for(module) if module in stored else None
            if scheme is None or scheme.kind != "wna16":
                continue
            group = scheme.group_size_for(in_features)
            share = in_features // tp_size
            if scheme.strategy == "group" and share % group:
                raise ConfigError(
                    "tensor_parallel_size",
                    tp_size,
                    f"{module} is quantized in groups of {group}: each rank's {share} of its "
                    f"{in_features} inputs would not hold whole groups",
                )


def check_parallelism(info: CheckpointInfo, tp_size: int = 1, pp_size: int = 1):
    """The checkpoint's model args, once they are known to split over `tp_size` tensor-parallel
    ranks and `pp_size` pipeline stages: a ConfigError naming the field otherwise (or naming
    `model` for a bad config.json). Rank 0 calls it before it starts any worker."""
    try:
        args = info.model_class.args_from_config(info.hf_config)
    except (KeyError, ValueError) as e:
        raise ConfigError("model", str(info.model_dir), f"bad config.json: {e}") from e
    arch = info.hf_config["architectures"][0]
    if tp_size > 1:
        if not info.model_class.supports_tensor_parallel:
            raise ConfigError("tensor_parallel_size", tp_size, f"{arch} is not sharded yet")
        TensorParallel(0, tp_size).check(args)
        if info.quantization is not None:
            _check_quantized_groups(info, args, tp_size)
    if pp_size > 1:
        if not info.model_class.supports_pipeline_parallel:
            raise ConfigError(
                "pipeline_parallel_size", pp_size, f"{arch} is not split into stages yet"
            )
        PipelineStage(0, pp_size).layers(args.num_layers)
    return args


def as_checkpoint_info(checkpoint: CheckpointInfo | str | Path) -> CheckpointInfo:
    """`checkpoint` itself, or the info read from that directory."""
    if isinstance(checkpoint, CheckpointInfo):
        return checkpoint
    return read_checkpoint_info(checkpoint)
