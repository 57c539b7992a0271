"""backend_lib/llm imports one way, down its floors: serving -> engine -> spec_decode ->
execution -> core -> {lora, structured} -> the top-level modules config.py ->
{speculative_config.py, kv_events_config.py, kv_offload_config.py,
multimodal_config.py, cuda_graph_config.py}. A module may import its own package and any lower floor, never a higher
one nor a package beside it. Checked on the source (every `import` and `from ... import`,
including those inside functions), so a new arrow back up fails here, not in review."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LLM = Path(__file__).resolve().parents[2] / "backend_lib" / "llm"

FLOORS: tuple[tuple[str, ...], ...] = (
    ("serving",),
    ("engine",),
    ("spec_decode",),
    ("execution",),
    ("core",),
    ("lora", "structured"),
    ("config",),
    (
        "speculative_config",
        "kv_events_config",
        "kv_offload_config",
        "multimodal_config",
        "cuda_graph_config",
    ),
)
"""Top floor first; a floor's packages (or top-level modules) do not import each other."""

FLOOR_OF = {name: level for level, names in enumerate(FLOORS) for name in names}


def unit_of(path: Path) -> str:
    """The package (or top-level module) of backend_lib/llm that `path` belongs to."""
    relative = path.relative_to(LLM)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def absolute_module(node: ast.ImportFrom, package: str) -> str:
    """The module an import-from names, relative ones (`from ..core import x`) resolved against
    the importing module's `package`."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imported_units(source: str, package: str = "backend_lib.llm.serving") -> set[str]:
    """The backend_lib.llm packages and top-level modules `source`, a module of `package`,
    imports."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.ImportFrom):
            module = absolute_module(node, package)
            names = [module]
            if module == "backend_lib.llm":  # from backend_lib.llm import config
                names = [f"backend_lib.llm.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["backend_lib", "llm"] and len(parts) > 2:
                found.add(parts[2])
    return found


def package_of(path: Path) -> str:
    """The dotted package of a module file under backend_lib/llm."""
    return ".".join(("backend_lib", "llm", *path.parent.relative_to(LLM).parts))


def upward_imports(unit: str, source: str, package: str) -> list[str]:
    """What `source`, a module of `package` in `unit`, imports from its own floor's other units or
    above."""
    floor = FLOOR_OF[unit]
    return sorted(
        other
        for other in imported_units(source, package)
        if other != unit and other in FLOOR_OF and FLOOR_OF[other] <= floor
    )


def llm_modules() -> list[Path]:
    return sorted(
        path for path in LLM.rglob("*.py") if path.name != "__init__.py" or path.parent != LLM
    )


def test_every_package_has_a_floor():
    """A new package or top-level module must be placed (else nothing would check it)."""
    units = {unit_of(path) for path in llm_modules()}
    assert units - FLOOR_OF.keys() == set()
    assert FLOOR_OF.keys() - units == set()


@pytest.mark.parametrize("unit", sorted(FLOOR_OF))
def test_imports_run_one_way(unit):
    wrong = {
        str(path.relative_to(LLM)): upward_imports(
            unit, path.read_text(encoding="utf-8"), package_of(path)
        )
        for path in llm_modules()
        if unit_of(path) == unit
    }
    assert {file: units for file, units in wrong.items() if units} == {}


def test_the_check_sees_imports():
    """The scanner finds the arrows that do exist (so an empty result above means something)."""
    read = lambda *parts: LLM.joinpath(*parts).read_text(encoding="utf-8")  # noqa: E731
    assert "engine" in imported_units(read("serving", "service.py"))
    assert {"core", "execution", "spec_decode"} <= imported_units(read("engine", "llm_engine.py"))
    assert "execution" in imported_units(read("spec_decode", "draft_model.py"))


@pytest.mark.parametrize(
    ("unit", "line", "upward"),
    [
        ("execution", "from backend_lib.llm.spec_decode.verifier import verify", ["spec_decode"]),
        ("spec_decode", "from backend_lib.llm.engine import drafter", ["engine"]),
        ("core", "import backend_lib.llm.execution.sampler", ["execution"]),
        ("config", "from backend_lib.llm.core.outputs import RequestOutput", ["core"]),
        ("lora", "from backend_lib.llm import structured", ["structured"]),
        ("engine", "    from backend_lib.llm.serving.service import LLMService", ["serving"]),
        ("engine", "from ..serving.engine_loop import EngineLoop", ["serving"]),
        ("execution", "from .. import engine", ["engine"]),
        ("engine", "from backend_lib.llm.spec_decode.verifier import verify", []),
        ("engine", "from ..core.outputs import RequestOutput", []),
    ],
)
def test_an_added_upward_import_fails(unit, line, upward):
    """Self-test: a real module of `unit` with one more import line is caught (or, for a
    downward import, passes)."""
    module = next(path for path in llm_modules() if unit_of(path) == unit)
    source = module.read_text(encoding="utf-8")
    if line.startswith(" "):  # inside a function
        line = f"def _added():\n{line}\n"
    package = package_of(module)
    assert upward_imports(unit, source, package) == []
    assert upward_imports(unit, f"{source}\n{line}\n", package) == upward
