"""`kernels/` depends on nothing in the project: it imports only torch, triton, the standard library
and itself, so it can be benchmarked, tested and reused without the serving code (the choice of a
backend for a device is backend_lib's policy: backend_lib/llm/execution/kernel_backend.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
KERNELS_DIR = REPO_ROOT / "kernels"
ALLOWED = {"kernels", "torch", "triton", *sys.stdlib_module_names}


def imported_names(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `path`, nested ones included; relative
    imports stay inside the package and are left out."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append((node.lineno, node.module))
    return names


def test_kernel_modules_import_only_torch_triton_stdlib_and_kernels():
    files = sorted(KERNELS_DIR.rglob("*.py"))
    assert KERNELS_DIR / "__init__.py" in files
    offenders = [
        f"{path.relative_to(REPO_ROOT)}:{line}: {name}"
        for path in files
        for line, name in imported_names(path)
        if name.split(".")[0] not in ALLOWED
    ]
    assert not offenders, "kernels/ imports outside torch, triton and itself:\n" + "\n".join(
        offenders
    )


# Run in a fresh interpreter: this one has already imported the whole project.
_LOADED_PROJECT_MODULES = """
import sys
from pathlib import Path

import kernels

root, own = Path.cwd().resolve(), Path("kernels").resolve()
env = Path(sys.prefix).resolve()


def locations(module):
    yield getattr(module, "__file__", None)
    try:
        yield from getattr(module, "__path__", None) or ()
    except TypeError:  # torch.classes answers any attribute, __path__ included
        pass


def in_project(module) -> bool:
    for location in locations(module):
        # Relative names are no locations (torch.ops' __file__ is "_ops.py").
        if isinstance(location, str) and Path(location).is_absolute():
            p = Path(location).resolve()
            if p.is_relative_to(root) and not (p.is_relative_to(own) or p.is_relative_to(env)):
                return True
    return False


for name, module in sorted(sys.modules.items()):
    if name.startswith("backend_lib") or in_project(module):
        print(name)
"""


def test_importing_kernels_loads_nothing_else_of_the_project():
    result = subprocess.run(
        [sys.executable, "-c", _LOADED_PROJECT_MODULES],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [], "importing kernels loaded: " + result.stdout
