"""The C++ CPU kernels (kernels/csrc/): built once by `make setup`, loaded by path at run time.

Build (`python -m kernels.cpu_build`, run by `make setup` when a source changes): the system C++
compiler ($CXX, else c++, g++ or clang++) with torch's headers and libraries
(torch.utils.cpp_extension's paths), one shared library registering `torch.ops.llm_cpu.*`, written
to .cache/kernels/ with a manifest (torch version, ISA, source hash). The ISA is the best level the
building CPU and torch share (AVX-512, AVX2 or baseline), not -march=native: an image built on one
machine may run on another. No compiler, or a failed compile: nothing is built, one line says why,
and the PyTorch paths serve.

Load (`load()`, once per process, on the first CPU attention plan): never compiles. The library is loaded only when its manifest
matches this torch, these sources and a CPU able to run its ISA; otherwise (or when loading fails)
it returns False and logs why once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(sorted((Path(__file__).parent / "csrc").glob("*.cpp")))
"""Every C++ source of kernels/csrc/ (the Makefile's rule depends on the same wildcard)."""
HEADERS = tuple(sorted((Path(__file__).parent / "csrc").glob("*.h")))
"""The headers they include (hashed with them: a changed header rebuilds too)."""
BUILD_DIR = Path(__file__).resolve().parents[1] / ".cache" / "kernels"
LIBRARY = "llm_cpu.so"
MANIFEST = "llm_cpu.json"

# ISA levels, lowest first: (name, torch.backends.cpu.get_cpu_capability() value, compiler flags).
_ISAS = (
    ("default", "DEFAULT", ()),
    ("avx2", "AVX2", ("-mavx2", "-mfma", "-mf16c")),
    (
        "avx512",
        "AVX512",
        ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"),
    ),
)


def _isa_rank(name: str) -> int:
    return next((i for i, (isa, _, _) in enumerate(_ISAS) if isa == name), -1)


def _cpu_isa() -> str:
    """The best level of _ISAS this CPU runs (as torch detects it; ATEN_CPU_CAPABILITY lowers it)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "default"
    capability = torch.backends.cpu.get_cpu_capability()
    return next((isa for isa, cap, _ in reversed(_ISAS) if cap == capability), "default")


def _source_hash() -> str:
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    return digest.hexdigest()


def _expected_manifest() -> dict:
    """What a usable build records: everything that must match the running process."""
    return {
        "torch": torch.__version__,
        "machine": platform.machine(),
        "sources": _source_hash(),
    }


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build(build_dir: Path = BUILD_DIR) -> tuple[bool, str]:
    """Compile SOURCES into build_dir/LIBRARY; (built, one line saying what happened). Each source
    compiles in its own compiler process, as many at once as there are cores, then one link."""
    compiler = _compiler()
    if compiler is None:
        return False, "no C++ compiler ($CXX, c++, g++, clang++) found"
    from torch.utils import cpp_extension  # only the build needs it (it is slow to import)

    isa = _cpu_isa()
    flags = next(flags for name, _, flags in _ISAS if name == isa)
    torch_lib = cpp_extension.library_paths()[0]
    compile_flags = [
        "-fPIC",
        "-std=c++20",
        "-O3",
        # at::parallel_for is a header template over `#pragma omp parallel`: without OpenMP it runs
        # serially. libgomp.so.1 resolves to the copy torch has already loaded.
        "-fopenmp",
        *flags,
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{path}" for path in cpp_extension.include_paths()),
    ]
    link_flags = ["-shared", "-fopenmp", f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}"]
    build_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=build_dir) as object_dir:
        objects = [str(Path(object_dir) / f"{source.stem}.o") for source in SOURCES]
        commands = [
            [compiler, "-c", str(source), "-o", obj, *compile_flags]
            for source, obj in zip(SOURCES, objects, strict=True)
        ]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            failed = [r for r in pool.map(_run, commands) if r is not None]
        if failed:
            return False, failed[0]
        # Written beside the target and renamed over it: a process loading it never sees half a file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=build_dir)
        os.close(fd)
        link = [compiler, *objects, "-o", tmp, *link_flags, "-lc10", "-ltorch_cpu"]
        failure = _run(link)
    if failure is not None:
        Path(tmp).unlink(missing_ok=True)
        return False, failure
    os.chmod(tmp, 0o755)  # mkstemp's 0600 would hide it from another user (a container's)
    os.replace(tmp, build_dir / LIBRARY)
    manifest = {**_expected_manifest(), "isa": isa, "commands": [*commands, link]}
    (build_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return True, f"{isa}, {time.monotonic() - start:.0f} s: {build_dir / LIBRARY}"


def _run(command: list[str]) -> str | None:
    """Run one compiler command; why it failed, or None."""
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode == 0:
        return None
    return f"compile failed ({' '.join(command)}):\n{result.stderr[-4000:]}"


def check_build(build_dir: Path = BUILD_DIR) -> str | None:
    """Why the library in build_dir cannot be loaded in this process (None: it can)."""
    library, manifest_path = build_dir / LIBRARY, build_dir / MANIFEST
    if not library.exists() or not manifest_path.exists():
        return f"not built ({library} missing: run `make setup`)"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return f"unreadable manifest {manifest_path}: {error}"
    for key, want in _expected_manifest().items():
        if manifest.get(key) != want:
            return f"stale build ({key} changed since it was built: run `make setup`)"
    if _isa_rank(manifest.get("isa", "")) < 0 or _isa_rank(manifest["isa"]) > _isa_rank(_cpu_isa()):
        return f"built for {manifest.get('isa')!r}, this CPU runs {_cpu_isa()!r}"
    return None


def load_from(build_dir: Path) -> str | None:
    """Load the library built in build_dir (torch.ops.llm_cpu.* then exist); why not, or None."""
    reason = check_build(build_dir)
    if reason is None:
        try:
            torch.ops.load_library(str(build_dir / LIBRARY))
        except (OSError, RuntimeError) as error:
            reason = f"failed to load {build_dir / LIBRARY}: {error}"
    return reason


NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes the library's ops compute in (float32 inside)."""


def takes(tensor: torch.Tensor) -> bool:
    """Whether the library's ops take `tensor`: loaded, a CPU tensor, a dtype of NATIVE_DTYPES."""
    # is_cpu, not device.type: asked several times per layer, and building the device costs ~1 us.
    return tensor.is_cpu and tensor.dtype in NATIVE_DTYPES and load()


@functools.cache
def load() -> bool:
    """Load the built library once per process; False, with one logged reason, when it is missing,
    stale, built for another CPU or fails to load."""
    reason = load_from(BUILD_DIR)
    if reason is not None:
        log.warning("C++ CPU kernels unavailable, using the PyTorch paths: %s", reason)
    return reason is None
