"""What a process imports at start: every Triton stub (`model.py` imports its service) and every
tensor- or pipeline-parallel worker imports one of the modules below before it loads a model.
None may pull in transformers' modeling stack, compressed-tensors or torch.compile: together they
took ~7 s of CPU of a ~13 s import on a 2-core machine, paid by each stub and worker although only
some checkpoints (compressed-tensors ones, models with images) need them, and those import them
where they load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

HEAVY = (
    "compressed_tensors",
    "transformers.modeling_utils",
    "torch._dynamo",
    "torch._inductor",
    "sympy",
)
"""Modules a process start must not import (each drags in most of the others)."""

PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps([name for name in sys.argv[2:] if name in sys.modules]))
"""


@pytest.mark.parametrize(
    "module",
    (
        "backend_lib.llm.serving.service",
        "backend_lib.encoder.service",
        "backend_lib.llm.execution.worker",
    ),
)
def test_a_process_start_leaves_the_modeling_stack_unimported(module):
    assert imported_by(module, HEAVY) == []


def test_a_worker_start_imports_neither_transformers_nor_xgrammar():
    """A worker rank never tokenizes, compiles a grammar or fills a bitmask (rank 0 does): the
    ~2 s they cost each worker start are spent where a vision tower or a grammar is loaded."""
    assert imported_by("backend_lib.llm.execution.worker", ("transformers", "xgrammar")) == []


def imported_by(module: str, names: tuple[str, ...]) -> list[str]:
    """Which of `names` a fresh interpreter has imported after importing `module`."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, module, *names],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.splitlines()[-1])
