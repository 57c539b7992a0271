"""The peers' own environment, `.venv-peers`: built on first use from bench/peers/requirements.txt.

It is never mixed into the runtime's dependencies (optimum-intel pins an older transformers). A
stamp holding the hash of the requirements marks a finished build; a changed requirements file
rebuilds it. Each step is printed; a failed step raises `PeersUnavailable` naming it. The directory
holds a `.gitignore` of its own, as does the conversion cache (`.cache/bench-peers/`).

    python -m bench.peers.env     # build (or check) it now
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from bench.output import progress

REPO_ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = Path(__file__).with_name("requirements.txt")
NO_DEPS = Path(__file__).with_name("no-deps.txt")
"""Installed without their dependencies, after REQUIREMENTS (the file says why)."""
VENV = Path(os.environ.get("BENCH_PEERS_VENV", REPO_ROOT / ".venv-peers"))
CACHE = Path(os.environ.get("BENCH_PEERS_CACHE", REPO_ROOT / ".cache" / "bench-peers"))
STAMP = ".bench-peers-stamp"
CHECK_IMPORTS = (
    "import openvino, openvino_genai, ctranslate2, onnxruntime, optimum.intel, llama_cpp"
)
PIP_TIMEOUT_S = 1800
LLAMA_CPP = "llama-cpp-python==0.3.36"
"""llama.cpp's Python binding, built from its source distribution (PyPI has no CPU wheel) for this
CPU's instruction sets (`llama_cpp_cmake_args`), its wheel cached per CPU under WHEELS."""
GGML_ISA_FLAGS = {
    "sse4_2": "GGML_SSE42",
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "bmi2": "GGML_BMI2",
    "avx_vnni": "GGML_AVX_VNNI",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
}
"""/proc/cpuinfo flag -> the ggml option that compiles for it. AMX is left out: llama.cpp's AMX
kernels (chosen for Q4_0/Q8_0 when built with -march=native on a CPU that has AMX) died with
SIGILL at `tilezero` on this project's VMs, though the kernel grants the tile state; the other
options are what -march=native would enable."""
WHEELS = REPO_ROOT / ".cache" / "wheels"
BUILD_TIMEOUT_S = 3600


class PeersUnavailable(RuntimeError):
    """The peer systems cannot run; the message says which step failed and why."""


def python() -> Path:
    """The peers' interpreter, building the environment first if needed."""
    ensure()
    return VENV / "bin" / "python"


def ensure() -> None:
    """Build `.venv-peers` unless a finished build of the current requirements is there."""
    stamp = VENV / STAMP
    wanted = requirements_hash()
    if stamp.exists() and stamp.read_text().strip() == wanted:
        return
    progress(f"peers: building {VENV} from {REQUIREMENTS.relative_to(REPO_ROOT)} (first use)")
    if not (VENV / "bin" / "python").exists():
        run_step("create the virtual environment", [sys.executable, "-m", "venv", str(VENV)], 300)
    ignore_all(VENV)
    pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    run_step("pip install the pinned peers", [*pip, "-q", "-r", str(REQUIREMENTS)], PIP_TIMEOUT_S)
    run_step("pip install --no-deps", [*pip, "-q", "--no-deps", "-r", str(NO_DEPS)], PIP_TIMEOUT_S)
    wheel = llama_cpp_wheel()
    install = [*pip, "-q", "--no-deps", "--force-reinstall", str(wheel)]  # same version, new build
    run_step("pip install llama.cpp's wheel", install, PIP_TIMEOUT_S)
    run_step("import the peers", [str(VENV / "bin" / "python"), "-c", CHECK_IMPORTS], 300)
    stamp.write_text(wanted + "\n")
    progress(f"peers: {VENV} ready")


def llama_cpp_wheel() -> Path:
    """The llama-cpp-python wheel built for this CPU, building it first if needed (about 3
    minutes on 2 cores)."""
    folder = WHEELS / f"llama-cpp-{cpu_features_hash()}"
    built = sorted(folder.glob("llama_cpp_python-*.whl"))
    if built:
        return built[-1]
    ignore_all(WHEELS)
    environ = {**os.environ, "CMAKE_ARGS": llama_cpp_cmake_args()}
    environ.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
    # --no-cache-dir: pip's wheel cache keys on the source alone, not on CMAKE_ARGS.
    command = [str(VENV / "bin" / "python"), "-m", "pip", "wheel", "--no-deps", "--no-cache-dir"]
    command.append(LLAMA_CPP)
    run_step("build llama.cpp's wheel", [*command, "-w", str(folder)], BUILD_TIMEOUT_S, environ)
    return next(folder.glob("llama_cpp_python-*.whl"))


def llama_cpp_cmake_args() -> str:
    """The build's CMake options: this CPU's instruction sets (GGML_ISA_FLAGS), only the
    library (no tools, tests or examples)."""
    flags = set(cpu_flags())
    options = {"GGML_NATIVE": "OFF", "LLAMA_CURL": "OFF"}
    options |= {f"LLAMA_BUILD_{part}": "OFF" for part in ("TESTS", "EXAMPLES", "TOOLS", "SERVER")}
    options |= {name: "ON" if flag in flags else "OFF" for flag, name in GGML_ISA_FLAGS.items()}
    return " ".join(f"-D{name}={value}" for name, value in options.items())


def cpu_features_hash() -> str:
    """What the build depends on: the CPU's instruction sets and the build's options."""
    return hashlib.sha256(llama_cpp_cmake_args().encode()).hexdigest()[:12]


def cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return line.split(":", 1)[1].split()
    return []


def ignore_all(directory: Path) -> None:
    """Make git ignore `directory` whatever the repository's .gitignore says."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ".gitignore").write_text("*\n")


def requirements_hash() -> str:
    """What a build depends on: the pins."""
    pins = REQUIREMENTS.read_bytes() + NO_DEPS.read_bytes() + LLAMA_CPP.encode()
    return hashlib.sha256(pins + llama_cpp_cmake_args().encode()).hexdigest()


def run_step(name: str, command: list[str], timeout: float, environ=None) -> None:
    progress(f"peers: {name}: {' '.join(command)}")
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environ)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PeersUnavailable(f"building {VENV} failed at step '{name}': {exc}") from exc
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        raise PeersUnavailable(
            f"building {VENV} failed at step '{name}' (exit {proc.returncode}): " + " | ".join(tail)
        )


if __name__ == "__main__":
    try:
        print(python())
    except PeersUnavailable as exc:
        raise SystemExit(str(exc)) from exc
