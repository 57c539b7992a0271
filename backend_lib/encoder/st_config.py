"""What a checkpoint's sentence-transformers files say about inference.

Embedding models: `modules.json` (the module pipeline), `1_Pooling/config.json` (pooling
modes, `include_prompt`), `sentence_bert_config.json` (max_seq_length, do_lower_case),
`config_sentence_transformers.json` (`prompts`, `default_prompt_name`), and config.json's
`matryoshka_dimensions` (vLLM's convention: the sizes the vectors may be truncated to). Without
`modules.json`, sentence-transformers wraps a plain Hugging Face model as Transformer +
mean pooling and reads no prompts, and so does this reader.

Cross-encoders: the activation applied to the logit, resolved in the order of
sentence-transformers 6.x `CrossEncoder` (see `read_cross_encoder_activation`); for a causal-LM
reranker, the two tokens its `LogitScore` module scores (`read_logit_score`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend_lib.config import ConfigError
from backend_lib.encoder.pooling import POOLING_MODES

# Legacy boolean keys of 1_Pooling/config.json, in sentence-transformers' concatenation order.
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# Activation class paths sentence-transformers writes -> our names.
_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
}


@dataclass(frozen=True)
class EmbeddingLayout:
    """Inference settings of a sentence-transformers embedding checkpoint."""

    pooling_modes: tuple[str, ...]
    normalize: bool
    max_seq_length: int | None  # None: not set by the sentence-transformers files
    do_lower_case: bool
    prompts: dict[str, str] = field(default_factory=dict)  # prompt name -> text prepended
    default_prompt_name: str | None = None  # the prompt of a request that names none
    include_prompt: bool = True  # False: the prompt's tokens are left out of pooling
    matryoshka_dimensions: tuple[int, ...] = ()  # sizes a vector may be cut to, besides its own


def read_json(path: Path, spec: str) -> Any:
    """A checkpoint JSON file; ConfigError on the model naming the file when unreadable."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError("model", spec, f"cannot read {path.name}: {exc}") from None


def module_kind(entry: dict[str, Any]) -> str:
    """A modules.json entry's class name."""
    # "sentence_transformers.models.Pooling", "...base.modules.transformer.Transformer" -> last part
    return str(entry.get("type", "")).rsplit(".", 1)[-1]


def module_kinds(model_dir: Path, spec: str) -> list[str]:
    """The class names of modules.json's modules in order ("Transformer", "Pooling", ...); []
    without modules.json."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return []
    return [module_kind(m) for m in sorted(read_json(path, spec), key=lambda m: m.get("idx", 0))]


def _pooling_modes(config: dict[str, Any], spec: str) -> tuple[str, ...]:
    if "pooling_mode" in config:
        raw = config["pooling_mode"]
        modes = (raw,) if isinstance(raw, str) else tuple(raw)
    else:
        modes = tuple(mode for key, mode in _LEGACY_POOLING_KEYS.items() if config.get(key))
    modes = modes or ("mean",)
    for mode in modes:
        if mode not in POOLING_MODES:
            raise ConfigError("model", spec, f"unsupported pooling mode '{mode}'")
    return modes


def sentence_bert_config(model_dir: Path, spec: str) -> dict[str, Any]:
    """sentence_bert_config.json ({} when absent)."""
    path = model_dir / "sentence_bert_config.json"
    return read_json(path, spec) if path.is_file() else {}


def read_max_seq_length(model_dir: Path, spec: str) -> int | None:
    """`max_seq_length` of sentence_bert_config.json, None when absent."""
    return sentence_bert_config(model_dir, spec).get("max_seq_length")


def read_prompts(model_dir: Path, spec: str) -> tuple[dict[str, str], str | None]:
    """`prompts` and `default_prompt_name` of config_sentence_transformers.json (none if absent);
    the default must name a prompt, as sentence-transformers requires at load."""
    path = model_dir / "config_sentence_transformers.json"
    config = read_json(path, spec) if path.is_file() else {}
    prompts = config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()
    ):
        raise ConfigError("model", spec, "`prompts` must map prompt names to strings")
    default = config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ConfigError(
            "model",
            spec,
            f"default_prompt_name '{default}' is not one of the prompts {sorted(prompts)}",
        )
    return dict(prompts), default


def _matryoshka_dimensions(model_dir: Path, spec: str) -> tuple[int, ...]:
    path = model_dir / "config.json"
    sizes = (read_json(path, spec) if path.is_file() else {}).get("matryoshka_dimensions") or []
    if not isinstance(sizes, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in sizes
    ):
        raise ConfigError(
            "model", spec, f"config.json matryoshka_dimensions must be a list of ints >= 1: {sizes}"
        )
    return tuple(sorted(set(sizes)))


def read_embedding_layout(model_dir: Path, spec: str) -> EmbeddingLayout:
    """Read pooling, normalisation, sequence, prompt and Matryoshka settings; unsupported modules
    are errors."""
    bert_config = sentence_bert_config(model_dir, spec)
    max_seq_length = bert_config.get("max_seq_length")
    do_lower_case = bool(bert_config.get("do_lower_case", False))
    matryoshka = _matryoshka_dimensions(model_dir, spec)
    if not (model_dir / "modules.json").is_file():
        return EmbeddingLayout(
            ("mean",), False, max_seq_length, do_lower_case, matryoshka_dimensions=matryoshka
        )

    modules = sorted(read_json(model_dir / "modules.json", spec), key=lambda m: m.get("idx", 0))
    kinds = [module_kind(m) for m in modules]
    if not kinds or kinds[0] != "Transformer" or modules[0].get("path", "") not in ("", "."):
        raise ConfigError(
            "model",
            spec,
            "modules.json must start with a Transformer module stored at the model root",
        )
    unsupported = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
    if unsupported or kinds.count("Pooling") > 1:
        raise ConfigError(
            "model", spec, f"unsupported sentence-transformers modules: {unsupported or kinds}"
        )
    modes: tuple[str, ...] = ("mean",)
    include_prompt = True
    if "Pooling" in kinds:
        entry = modules[kinds.index("Pooling")]
        pooling = read_json(model_dir / entry["path"] / "config.json", spec)
        modes = _pooling_modes(pooling, spec)
        include_prompt = bool(pooling.get("include_prompt", True))
    prompts, default_prompt_name = read_prompts(model_dir, spec)
    return EmbeddingLayout(
        modes,
        "Normalize" in kinds,
        max_seq_length,
        do_lower_case,
        prompts,
        default_prompt_name,
        include_prompt,
        matryoshka,
    )


def _activation_name(path: str | None) -> str | None:
    # sentence-transformers ignores activation paths outside torch.* unless trust_remote_code.
    if path is None or not path.startswith("torch."):
        return None
    return _ACTIVATIONS.get(path, path)


def read_cross_encoder_activation(model_dir: Path, spec: str, num_labels: int) -> str:
    """The activation `CrossEncoder.predict` applies: "sigmoid", "identity" or "tanh".

    Order (sentence-transformers 6.x): `config_sentence_transformers.json` `activation_fn`
    of a saved CrossEncoder (with modules.json); then config.json
    `sentence_transformers.activation_fn`; then the legacy
    `sbert_ce_default_activation_function`; else Sigmoid for one label, Identity otherwise.
    """
    candidates: list[str | None] = []
    st_file = model_dir / "config_sentence_transformers.json"
    if (model_dir / "modules.json").is_file() and st_file.is_file():
        st_config = read_json(st_file, spec)
        if st_config.get("model_type") == "CrossEncoder":
            candidates.append(st_config.get("activation_fn"))
    config = read_json(model_dir / "config.json", spec)
    st_section = config.get("sentence_transformers") or {}
    if "activation_fn" in st_section:
        candidates.append(st_section["activation_fn"])
    elif config.get("sbert_ce_default_activation_function") is not None:
        candidates.append(config["sbert_ce_default_activation_function"])
    for path in candidates:
        name = _activation_name(path)
        if name is None:
            continue
        if name not in _ACTIVATIONS.values():
            raise ConfigError("model", spec, f"unsupported cross-encoder activation '{path}'")
        return name
    return "sigmoid" if num_labels == 1 else "identity"


@dataclass(frozen=True)
class LogitScoreTokens:
    """A causal-LM reranker's score: logit[true_token_id] - logit[false_token_id] at the last token
    (the true token's logit alone when false_token_id is None)."""

    true_token_id: int
    false_token_id: int | None = None


def read_logit_score(model_dir: Path, spec: str) -> LogitScoreTokens | None:
    """The tokens of modules.json's `LogitScore` module (sentence-transformers 6.x), None without
    one."""
    if not (model_dir / "modules.json").is_file():
        return None
    modules = read_json(model_dir / "modules.json", spec)
    entry = next((m for m in modules if module_kind(m) == "LogitScore"), None)
    if entry is None:
        return None
    config = read_json(model_dir / entry.get("path", "") / "config.json", spec)
    true_id, false_id = config.get("true_token_id"), config.get("false_token_id")
    if not isinstance(true_id, int) or not (false_id is None or isinstance(false_id, int)):
        raise ConfigError(
            "model", spec, f"LogitScore needs integer token ids, got {true_id!r} and {false_id!r}"
        )
    return LogitScoreTokens(true_id, false_id)
