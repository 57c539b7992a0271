"""GPTQ and AWQ checkpoints made, and dequantized, by the formats' own libraries: GPTQModel for
GPTQ, AutoAWQ for AWQ (tooling/gptq_awq_reference.py says exactly which of their functions).

Neither library can live in .venv (their pins clash with requirements.txt: GPTQModel pulls a CUDA
torch 2.14), so `reference_env()` installs the pinned few packages of
tooling/gptq_awq_reference.txt with `pip install --no-deps --target .cache/gptq-awq-reference/`
on first use (about 15 s of CPU, half a minute on a busy 2-core machine: most are sdists, built
with the venv's own setuptools; a stamp holding the pins' hash marks a finished build, a file lock
keeps concurrent test workers from building it twice), and the libraries then run in a subprocess of
this interpreter with that directory on its path, so the main venv's torch and transformers
serve them and nothing they patch on import reaches the caller.

`write_checkpoints(jobs)` writes any number of checkpoints in one such subprocess (its start,
importing GPTQModel, is most of the cost), each with the library's own dequantization of every
quantized layer beside it (`reference_dequantized_weights`).

    python -m tooling.gptq_awq_checkpoints --source models/shakespeare-llama --out DIR \\
        --method gptq --bits 4 --group-size 128 --desc-act
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = Path(__file__).with_name("gptq_awq_reference.txt")
ENV_DIR = Path(
    os.environ.get("GPTQ_AWQ_REFERENCE_DIR", REPO_ROOT / ".cache" / "gptq-awq-reference")
)
STAMP = ".reference-stamp"
PIP_TIMEOUT_S = 900
WRITE_TIMEOUT_S = 1800


class ReferenceUnavailable(RuntimeError):
    """The reference libraries could not be installed or run; the message says which step."""


@dataclass(frozen=True)
class GPTQSpec:
    """A GPTQ checkpoint as GPTQModel writes it: `format` "gptq" (v1: stored zero points minus one)
    or "gptq_v2"; `group_size` -1 for per channel; `dynamic` GPTQModel's per-module overrides
    ({"-:regex": {}} leaves matches in float, {"+:regex": {"bits": 8, ...}} overrides).
    `zero_point_zero` (asymmetric only): every 8th row's first group made non-negative, so its
    zero point is 0 (which v1 stores as -1, borrowing from the next value of its word)."""

    bits: int = 4
    group_size: int = 128
    desc_act: bool = False
    sym: bool = True
    format: str = "gptq"
    dynamic: dict | None = None
    zero_point_zero: bool = False
    seed: int = 0
    kind: str = field(default="gptq", init=False)


@dataclass(frozen=True)
class AWQSpec:
    """An AWQ GEMM checkpoint as AutoAWQ writes it (4 bits, zero points, `group_size` inputs per
    scale); `modules_to_not_convert`: substrings of module names left in float."""

    group_size: int = 128
    modules_to_not_convert: tuple[str, ...] | None = None
    kind: str = field(default="awq", init=False)


Spec = GPTQSpec | AWQSpec

# Presets for the Shakespeare model (hidden 256, MLP width 704 = 11 * 64: group 128 does not
# divide down_proj's inputs, so groups of 64 or 32, or per channel).
PRESETS: dict[str, Spec] = {
    "GPTQ_W4_G64": GPTQSpec(4, 64),
    "GPTQ_W4_G32_ASYM_DESC_ACT": GPTQSpec(4, 32, desc_act=True, sym=False, zero_point_zero=True),
    "GPTQ_W8_CHANNEL_DESC_ACT": GPTQSpec(8, -1, desc_act=True),
    "GPTQ_W8_G64_ASYM_DESC_ACT": GPTQSpec(8, 64, desc_act=True, sym=False, zero_point_zero=True),
    "GPTQ_W4_G64_ASYM_V2": GPTQSpec(4, 64, sym=False, format="gptq_v2", zero_point_zero=True),
    "GPTQ_W4_G64_DYNAMIC": GPTQSpec(
        4,
        64,
        dynamic={
            r"-:model\.layers\.0\.self_attn\..*": {},
            r"+:.*down_proj": {"bits": 8, "group_size": 32, "sym": False},
        },
    ),
    "AWQ_G64": AWQSpec(64),
    "AWQ_G32_NOT_DOWN_PROJ": AWQSpec(32, modules_to_not_convert=("down_proj",)),
}


def reference_env() -> Path:
    """The directory holding the reference libraries, installed first if needed."""
    wanted = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    stamp = ENV_DIR / STAMP
    if stamp.is_file() and stamp.read_text().strip() == wanted:
        return ENV_DIR
    ENV_DIR.parent.mkdir(parents=True, exist_ok=True)
    with _locked(ENV_DIR.parent / f"{ENV_DIR.name}.lock"):
        if stamp.is_file() and stamp.read_text().strip() == wanted:
            return ENV_DIR
        staging = ENV_DIR.with_name(ENV_DIR.name + ".partial")
        for old in (staging, ENV_DIR):
            shutil.rmtree(old, ignore_errors=True)
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        command = [*pip, "--no-deps", "--target", str(staging), "-r", str(REQUIREMENTS)]
        try:  # most are sdists: built with the venv's setuptools (torch's), 3x faster
            _run([*command, "--no-build-isolation"], "pip install (no build isolation)", 600)
        except ReferenceUnavailable:
            shutil.rmtree(staging, ignore_errors=True)
            _run(command, "pip install the reference libraries", PIP_TIMEOUT_S)
        (staging / ".gitignore").write_text("*\n")
        (staging / STAMP).write_text(wanted + "\n")
        staging.rename(ENV_DIR)
    return ENV_DIR


def write_checkpoints(jobs: Sequence[tuple[Path, Spec, Path]]) -> list[Path]:
    """For each (source, spec, out) of `jobs`, write checkpoint `out` of float checkpoint
    `source` in `spec`, all in one subprocess of the reference libraries; returns the outs."""
    if not jobs:
        return []
    payload = [
        {**asdict(spec), "source": str(source), "out": str(out)} for source, spec, out in jobs
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(reference_env()), str(REPO_ROOT)])
    env["GPTQMODEL_DISABLE_PACK_EXT"] = "1"  # GPTQModel's Python packing, no JIT-built extension
    env.setdefault("OMP_NUM_THREADS", "1")
    command = [sys.executable, "-m", "tooling.gptq_awq_reference", json.dumps(payload)]
    _run(command, "write the checkpoints", WRITE_TIMEOUT_S, env=env, cwd=REPO_ROOT)
    return [Path(out) for _, _, out in jobs]


def cached_checkpoints(jobs: dict[str, tuple[Path, Spec]], cache: Path) -> dict[str, Path]:
    """name -> the checkpoint of float checkpoint `source` in `spec` for each name: (source,
    spec) of `jobs`, under `cache/<hash>/name`: written once (one subprocess for all the missing
    ones, under a lock shared by concurrent processes) and reused while the specs, the sources'
    files, the pins and the writer are the same."""
    key = hashlib.sha256()
    for part in (REQUIREMENTS, Path(__file__).with_name("gptq_awq_reference.py")):
        key.update(part.read_bytes())
    for name, (source, spec) in sorted(jobs.items()):
        key.update(json.dumps([name, asdict(spec)]).encode())
        for path in sorted(Path(source).glob("*")):
            if path.is_file():
                key.update(path.name.encode() + hashlib.sha256(path.read_bytes()).digest())
    root = Path(cache) / key.hexdigest()[:16]
    outs = {name: root / name for name in jobs}
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / ".lock"):
        missing = [(*jobs[n], out) for n, out in outs.items() if not (out / ".done").is_file()]
        for _, _, out in missing:
            shutil.rmtree(out, ignore_errors=True)
            reference_path(out).unlink(missing_ok=True)
        write_checkpoints(missing)
        for _, _, out in missing:
            (out / ".done").write_text("")
    return outs


def reference_path(checkpoint: Path) -> Path:
    """Where the library's dequantized weights of `checkpoint` are (beside it, not in it: the
    engine loads every .safetensors file of a checkpoint directory)."""
    checkpoint = Path(checkpoint)
    return checkpoint.with_name(checkpoint.name + ".reference.safetensors")


def reference_dequantized_weights(
    checkpoint: Path, dtype: torch.dtype = torch.float16
) -> dict[str, torch.Tensor]:
    """The library's own dequantization of every quantized layer of `checkpoint`, by checkpoint
    name ("model.layers.0.self_attn.q_proj.weight"), [out, in]: in float16 (the libraries' scale
    dtype, so each product rounded once to float16) or float32 (scales upcast: exact products)."""
    from safetensors.torch import load_file

    suffix = {torch.float16: "", torch.float32: "@float32"}[dtype]
    weights = load_file(reference_path(checkpoint))
    return {
        name.removesuffix(suffix): w
        for name, w in weights.items()
        if (suffix and name.endswith(suffix)) or (not suffix and "@" not in name)
    }


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(command: list[str], step: str, timeout: float, **kwargs) -> None:
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ReferenceUnavailable(f"step '{step}' failed: {exc}") from exc
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-20:]
        raise ReferenceUnavailable(
            f"step '{step}' failed (exit {proc.returncode}): " + "\n".join(tail)
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=REPO_ROOT / "models" / "shakespeare-llama")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--method", choices=("gptq", "awq"), default="gptq")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--desc-act", action="store_true")
    parser.add_argument("--asym", action="store_true", help="GPTQ with zero points")
    parser.add_argument("--format", choices=("gptq", "gptq_v2"), default="gptq")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="instead of the options above")
    args = parser.parse_args(argv)
    if args.preset:
        spec = PRESETS[args.preset]
    elif args.method == "awq":
        spec: Spec = AWQSpec(group_size=args.group_size)
    else:
        spec = GPTQSpec(args.bits, args.group_size, args.desc_act, not args.asym, args.format)
    (out,) = write_checkpoints([(args.source, spec, args.out)])
    print(f"{spec} checkpoint written to {out}")


if __name__ == "__main__":
    main()
