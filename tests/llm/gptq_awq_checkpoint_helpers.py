"""GPTQ and AWQ test checkpoints, written by GPTQModel and AutoAWQ themselves (their environment is
built on first use): the Shakespeare model in every preset of tooling/gptq_awq_checkpoints.py,
and each dense architecture's tiny random checkpoint (tests/llm/engine_helpers.py) in GPTQ
(4 bits, groups of 32, act-order, zero points) and AWQ (groups of 32). All are written in one
subprocess on first use and cached under .cache/gptq-awq-checkpoints/ (keyed by the specs, the
source files, the pins and the writer; concurrent test workers share one build)."""

from __future__ import annotations

from pathlib import Path

from tests.llm.engine_helpers import engine_checkpoint
from tests.llm.quantized_checkpoint_helpers import DENSE_ARCHITECTURES
from tests.llm.shakespeare_helpers import SHAKESPEARE
from tooling import gptq_awq_checkpoints
from tooling.gptq_awq_checkpoints import AWQSpec, GPTQSpec
from tooling.repository import REPO_ROOT

CACHE = REPO_ROOT / ".cache" / "gptq-awq-checkpoints"
PRESETS = tuple(gptq_awq_checkpoints.PRESETS)

DENSE_SPECS = {
    "GPTQ": GPTQSpec(4, 32, desc_act=True, sym=False, zero_point_zero=True),
    "AWQ": AWQSpec(32),
}

_BUILT: dict[str, Path] = {}


def _build() -> None:
    jobs = {name: (SHAKESPEARE, spec) for name, spec in gptq_awq_checkpoints.PRESETS.items()}
    for arch in DENSE_ARCHITECTURES:
        source, _ = engine_checkpoint(arch)
        for method, spec in DENSE_SPECS.items():
            jobs[f"{arch}-{method}"] = (source, spec)
    _BUILT.update(gptq_awq_checkpoints.cached_checkpoints(jobs, CACHE))


def gptq_awq_shakespeare(preset: str) -> Path:
    """The Shakespeare model written by its library in `preset` (read-only: copy to corrupt)."""
    if not _BUILT:
        _build()
    return _BUILT[preset]


def gptq_awq_tiny(arch: str, method: str) -> tuple[Path, Path]:
    """(float source, checkpoint) of `arch`'s tiny random checkpoint in `method` (GPTQ or AWQ)."""
    if not _BUILT:
        _build()
    return engine_checkpoint(arch)[0], _BUILT[f"{arch}-{method}"]
