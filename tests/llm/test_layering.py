"""backend_lib/llm's subpackages import one way: serving -> engine -> {core, execution} -> {lora,
structured}; execution may use core's types, core never execution's. Checked on the source (every
`import` and `from ... import`, including those inside functions), so a new arrow back up fails
here, not in review."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LLM = Path(__file__).resolve().parents[2] / "backend_lib" / "llm"
PACKAGES = ("serving", "engine", "core", "execution", "lora", "structured")

FORBIDDEN = {
    "core": {"engine", "execution", "serving"},
    "execution": {"engine", "serving"},
    "engine": {"serving"},
    "lora": {"core", "engine", "execution", "serving", "structured"},
    "structured": {"core", "engine", "execution", "serving", "lora"},
    "serving": set(),
}


def imported_packages(path: Path) -> set[str]:
    """The backend_lib.llm subpackages `path` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["backend_lib", "llm"] and len(parts) > 2 and parts[2] in PACKAGES:
                found.add(parts[2])
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_run_one_way(package):
    wrong = {
        str(path.relative_to(LLM)): sorted(imported_packages(path) & FORBIDDEN[package])
        for path in sorted((LLM / package).rglob("*.py"))
    }
    assert {file: pkgs for file, pkgs in wrong.items() if pkgs} == {}


def test_the_check_sees_imports():
    """The scanner finds the arrows that do exist (so an empty result above means something)."""
    assert "engine" in imported_packages(LLM / "serving" / "service.py")
    assert {"core", "execution"} <= imported_packages(LLM / "engine" / "llm_engine.py")
