"""The tests tree's own layout, so it cannot drift: no module imports from a `test_*` module (what
tests share lives in helper modules: `*_helpers.py`, conftest.py fixtures); tests/llm mirrors
backend_lib/llm, every `test_*.py` in the folder of the subpackage it tests (test_layering.py,
about the whole package, stays at tests/llm); and every folder of Python files is a package."""

from __future__ import annotations

import ast
from pathlib import Path

from tooling.repository import REPO_ROOT

TESTS = REPO_ROOT / "tests"
LLM_TESTS = TESTS / "llm"
LLM_PACKAGE = REPO_ROOT / "backend_lib" / "llm"
WHOLE_PACKAGE_TESTS = {"test_layering.py"}
"""tests/llm modules that test backend_lib/llm as a whole, not one subpackage."""


def python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def llm_subpackages() -> set[str]:
    return {p.parent.name for p in LLM_PACKAGE.glob("*/__init__.py")}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_test_module(module: str) -> bool:
    """`module` (absolute, dotted) is a project test module: a file test_*.py, or inside one."""
    parts = module.split(".")
    return any(
        part.startswith("test_") and REPO_ROOT.joinpath(*parts[:i], part + ".py").is_file()
        for i, part in enumerate(parts)
    )


def imports_of_test_modules(path: Path, source: str | None = None) -> list[str]:
    """'line: module' of every import in `path` (or `source`, as if it were `path`) of a test
    module, relative imports and `from package import test_x` included."""
    tree = ast.parse(path.read_text(encoding="utf-8") if source is None else source)
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            modules = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [f"{node.lineno}: {m}" for m in modules if is_test_module(m)]
    return found


def test_no_module_imports_from_a_test_module():
    found = {
        str(path.relative_to(REPO_ROOT)): imports
        for path in python_files()
        if (imports := imports_of_test_modules(path))
    }
    assert found == {}, "move what tests share into a *_helpers.py module or a conftest.py"


def test_the_import_check_sees_test_modules():
    """The scanner catches each way of naming a test module (so the empty result means something)."""
    here = TESTS / "kernels" / "attention_helpers.py"
    sources = [
        "from tests.kernels.test_paged_attention import CASES",
        "from tests.kernels import test_paged_attention",
        "import tests.kernels.test_paged_attention",
        "from .test_paged_attention import CASES",
        "from . import test_paged_attention",
        "from ..llm import test_layering",
        "def f():\n    from tests.llm.test_layering import LLM",
    ]
    for source in sources:
        assert imports_of_test_modules(here, source), source
    helpers = "from tests.llm.engine_helpers import make_engine\nfrom . import attention_helpers"
    assert imports_of_test_modules(here, helpers) == []


def test_llm_tests_live_in_the_folder_of_their_subpackage():
    subpackages = llm_subpackages()
    assert {"serving", "engine", "core", "execution", "lora", "structured"} <= subpackages
    misplaced = [
        str(path.relative_to(LLM_TESTS))
        for path in sorted(LLM_TESTS.rglob("test_*.py"))
        if path.relative_to(LLM_TESTS).parts[0] not in subpackages
        and path.relative_to(LLM_TESTS).as_posix() not in WHOLE_PACKAGE_TESTS
    ]
    assert misplaced == [], f"tests/llm/<one of {sorted(subpackages)}>/ is their home"


def test_llm_test_folders_are_llm_subpackages():
    folders = {p.parent.name for p in LLM_TESTS.glob("*/__init__.py")}
    assert folders - llm_subpackages() == set()


def test_every_folder_of_python_files_is_a_package():
    """Without __init__.py, two test files of one name in different folders would collide."""
    folders = {path.parent for path in python_files()}
    missing = [
        str(f.relative_to(REPO_ROOT)) for f in sorted(folders) if not (f / "__init__.py").is_file()
    ]
    assert missing == []
