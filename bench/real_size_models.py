"""The real-size benchmark's models: one random Llama of Llama-3.2-1B's shape (`SHAPE`) in every
format the systems compare on, built once and cached under `.cache/real-sizes/<key>/` (never in
git; each artefact's name hashes what it depends on: the shape, the seed, the library versions and
the code that writes it):

- `hf/`: the float32 checkpoint (transformers' `LlamaForCausalLM`), with a byte-level BPE
  tokenizer of the full vocabulary (tooling.checkpoints.write_byte_level_tokenizer: GGUF tools
  need one), what OpenVINO's exports and the compressed-tensors checkpoint start from;
- `w4a16-g128/`: its compressed-tensors W4A16 checkpoint (every Linear 4-bit, symmetric, groups
  of 128, the output head included: tooling.quantized_checkpoints.with_head; the token embedding
  in full precision);
- `gguf/<TYPE>.gguf` for GGUF_TYPES, written by tooling.gguf_checkpoints as llama.cpp's converter
  and `llama-quantize` lay them out: every projection in TYPE; the token embedding and output
  head as `llama-quantize` leaves them for that type (Q4_0: embedding Q4_0, head Q6_K).

A partial build is never taken for a finished one: each artefact is written under a temporary
name and renamed when complete. Building one removes its stale versions (the same artefact under
another key), and new GGUF files remove the engine's conversions of the old ones (CONVERSIONS):
a 1B model in every format takes ~30 GB.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict
from pathlib import Path

from bench.output import progress
from tooling.checkpoints import Sizes, build_random_llama

REPO_ROOT = Path(__file__).resolve().parents[1]
CACHE = REPO_ROOT / ".cache" / "real-sizes"
SHAPE = Sizes(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=32000)
"""Llama-3.2-1B's shape (head_dim 64; 1.1B parameters with an untied head)."""
CONVERSIONS = CACHE / "xdg"
"""The engine's GGUF conversions ($XDG_CACHE_HOME of the benchmark's process)."""
MAX_POSITIONS = 2048
GGUF_TYPES = {
    # type: (projections, token embedding, output head)
    "F32": ("F32", "F32", "F32"),
    "BF16": ("BF16", "BF16", "BF16"),
    "Q8_0": ("Q8_0", "Q8_0", "Q8_0"),
    "Q4_0": ("Q4_0", "Q4_0", "Q6_K"),
}
"""The GGUF files: each as `llama-quantize` writes that file type (its embedding and head)."""


def model_dir(seed: int = 0) -> Path:
    """This shape's cache folder for `seed` (not built yet, perhaps)."""
    return CACHE / f"llama-1b-{_key(seed, 'transformers', 'tooling/checkpoints.py')}"


def hf_checkpoint(seed: int = 0) -> Path:
    """The float32 checkpoint, built first if needed (about a minute, 4.4 GB)."""
    out = model_dir(seed) / "hf"
    if not _done(out):
        _remove_stale(out.parent)
        progress(f"real sizes: building the random 1B Llama in {out}")
        with _building(out) as partial:
            build_random_llama(SHAPE, partial, seed, MAX_POSITIONS, byte_level_tokenizer=True)
    return out


def w4a16_checkpoint(seed: int = 0) -> Path:
    """The compressed-tensors W4A16 group-128 checkpoint of `hf_checkpoint`, its head quantized."""
    from tooling.quantized_checkpoints import (
        W4A16_G128,
        with_head,
        write_compressed_tensors_checkpoint,
    )

    key = _key(seed, "compressed_tensors", "tooling/quantized_checkpoints.py")
    out = model_dir(seed) / f"w4a16-g128-{key}"
    if not _done(out):
        source = hf_checkpoint(seed)
        _remove_stale(out)
        progress(f"real sizes: quantizing {source} to W4A16 g128 in {out}")
        with _building(out) as partial:
            write_compressed_tensors_checkpoint(source, partial, with_head(W4A16_G128))
    return out


def gguf_file(kind: str, seed: int = 0) -> Path:
    """The GGUF file of `kind` (GGUF_TYPES) of `hf_checkpoint`."""
    from tooling.gguf_checkpoints import write_gguf

    key = _key(seed, "gguf", "tooling/gguf_checkpoints.py")
    out = model_dir(seed) / f"gguf-{key}" / f"{kind}.gguf"
    if not out.exists():
        source = hf_checkpoint(seed)
        projections, embedding, head = GGUF_TYPES[kind]
        if not out.parent.exists():
            _remove_stale(out.parent)
            shutil.rmtree(CONVERSIONS, ignore_errors=True)
        progress(f"real sizes: writing {out}")
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        write_gguf(source, partial, projections, embedding_type=embedding, output_type=head)
        partial.rename(out)
    return out


def parameters(seed: int = 0) -> int:
    """The checkpoint's parameter count (from its shape: no weights loaded)."""
    config = json.loads((hf_checkpoint(seed) / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = hidden // config["num_attention_heads"]
    attention = hidden * head_dim * (2 * config["num_attention_heads"])
    attention += hidden * head_dim * (2 * config["num_key_value_heads"])
    mlp = 3 * hidden * config["intermediate_size"]
    per_layer = attention + mlp + 2 * hidden
    return layers * per_layer + 2 * config["vocab_size"] * hidden + hidden


def _key(seed: int, library: str, writer: str) -> str:
    """A hash of the shape, the seed, `library`'s version and the `writer` source file."""
    from importlib.metadata import version

    digest = hashlib.sha256(json.dumps({**asdict(SHAPE), "seed": seed}).encode())
    digest.update(version(library.replace("_", "-")).encode())
    digest.update((REPO_ROOT / writer).read_bytes())
    return digest.hexdigest()[:12]


def _remove_stale(artefact: Path) -> None:
    """Remove the other keys' versions of `artefact` (<name>-<key>: its siblings <name>-*)."""
    name = artefact.name.rpartition("-")[0]
    if not artefact.parent.exists():
        return
    for stale in artefact.parent.glob(f"{name}-*"):
        if stale != artefact and stale.is_dir():
            progress(f"real sizes: removing the stale {stale}")
            shutil.rmtree(stale, ignore_errors=True)


def _done(folder: Path) -> bool:
    return (folder / "config.json").exists()


class _building:
    """A context writing a folder under `<name>.partial` and renaming it when complete."""

    def __init__(self, out: Path):
        self.out, self.partial = out, out.with_name(out.name + ".partial")

    def __enter__(self) -> Path:
        CACHE.mkdir(parents=True, exist_ok=True)
        (CACHE / ".gitignore").write_text("*\n")
        shutil.rmtree(self.partial, ignore_errors=True)
        self.partial.mkdir(parents=True)
        return self.partial

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            shutil.rmtree(self.out, ignore_errors=True)
            self.partial.rename(self.out)
        else:
            shutil.rmtree(self.partial, ignore_errors=True)
