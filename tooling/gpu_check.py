"""`make gpu-check`: what only a CUDA GPU can check, as one run of at most 8 minutes (sized for
one H200 when the `device` tool lends one), writing one JSON summary.

The steps, in order, each in its own process with what is left of the budget:

- `kernels`: tests/kernels, every Triton kernel compiled and run on CUDA against its PyTorch twin;
- `engine`: the engine's greedy-vs-transformers tests on CUDA with the Triton kernels
  (`LLM_TEST_DEVICE=cuda`, TF32 off so float32 matmuls match the CPU reference);
- `cuda_graph_decode`: the captured decode steps (CUDA graphs per batch-size bucket,
  backend_lib/llm/execution/decode_graphs.py): padded buckets replayed, greedy tokens equal to
  transformers', with the engine's own captured graphs;
- `bench`: a short GPU-mode `make bench` (`python -m bench --gpu --quick --only ...`).

Without a GPU it says so, writes the summary with `"gpu": false` and every step skipped, and exits
0, so that CI and CPU machines can run it. With one, it exits 1 when a step failed or ran out of
its time.

    python -m tooling.gpu_check [--out gpu_check.json] [--budget-seconds 480]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tooling.repository import REPO_ROOT

BUDGET_SECONDS = 480
OUTPUT_TAIL = 4000
"""Characters of a step's output kept in the summary."""
ENGINE_TESTS = (
    "tests/llm/engine/test_engine.py::test_greedy_batch_matches_generate",
    "tests/llm/engine/test_engine.py::test_prefix_cache_hits_keep_outputs_exact",
    "tests/llm/engine/test_engine.py::test_chunked_prefill_keeps_outputs_exact",
    "tests/llm/engine/test_engine.py::test_preemption_keeps_outputs_exact",
    "tests/llm/engine/test_kv_offload.py::test_tier_reads_back_evicted_prefixes_exactly",
)
DECODE_GRAPH_TESTS = "tests/llm/execution/test_decode_graphs.py"
BENCHMARKS = "engine,prefix_cache,kv_offload"


@dataclass(frozen=True)
class Step:
    name: str
    command: list[str]
    """Run in the repository root; empty: not built yet (recorded, not run)."""
    env: dict[str, str] = field(default_factory=dict)
    note: str = ""


@dataclass
class StepResult:
    name: str
    status: str
    """passed, failed, timeout, skipped or not_implemented."""
    seconds: float = 0.0
    returncode: int | None = None
    output_tail: str = ""
    note: str = ""


def steps(python: str = sys.executable) -> list[Step]:
    pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow"]
    return [
        Step("kernels", [*pytest, "tests/kernels"]),
        Step(
            "engine",
            [*pytest, *ENGINE_TESTS],
            env={"LLM_TEST_DEVICE": "cuda", "NVIDIA_TF32_OVERRIDE": "0"},
        ),
        Step(
            "cuda_graph_decode",
            [*pytest, DECODE_GRAPH_TESTS],
            env={"LLM_TEST_DEVICE": "cuda", "NVIDIA_TF32_OVERRIDE": "0"},
        ),
        Step(
            "bench",
            [
                python,
                "-m",
                "bench",
                "--gpu",
                "--quick",
                "--only",
                BENCHMARKS,
                "--out-dir",
                str(REPO_ROOT / ".cache" / "gpu-check-bench"),
            ],
        ),
    ]


def run_steps(plan: list[Step], budget_seconds: float) -> list[StepResult]:
    """Each step in turn, within what is left of the budget; a step past it is stopped."""
    deadline = time.monotonic() + budget_seconds
    results = []
    for step in plan:
        if not step.command:
            results.append(StepResult(step.name, "not_implemented", note=step.note))
            continue
        left = deadline - time.monotonic()
        if left <= 1:
            results.append(StepResult(step.name, "skipped", note="no time left in the budget"))
            continue
        results.append(_run(step, left))
    return results


def _run(step: Step, timeout: float) -> StepResult:
    start = time.monotonic()
    try:
        proc = subprocess.run(
            step.command,
            cwd=REPO_ROOT,
            env={**os.environ, **step.env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"") + (exc.stderr or b"")
        tail = output.decode(errors="replace") if isinstance(output, bytes) else str(output)
        return StepResult(
            step.name, "timeout", time.monotonic() - start, None, tail[-OUTPUT_TAIL:], step.note
        )
    status = "passed" if proc.returncode == 0 else "failed"
    tail = (proc.stdout + proc.stderr)[-OUTPUT_TAIL:]
    return StepResult(step.name, status, time.monotonic() - start, proc.returncode, tail, step.note)


def gpu_name() -> str | None:
    """The first CUDA device's name, None without one."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--budget-seconds", type=float, default=BUDGET_SECONDS)
    args = parser.parse_args(argv)
    gpu = gpu_name()
    if gpu is None:
        print("gpu-check: no CUDA GPU on this machine; its checks need one (all skipped)")
        results = [StepResult(s.name, "skipped", note="no CUDA GPU") for s in steps()]
    else:
        print(f"gpu-check on {gpu}, budget {args.budget_seconds:.0f} s")
        results = run_steps(steps(), args.budget_seconds)
        for result in results:
            print(f"  {result.name}: {result.status} ({result.seconds:.0f} s)")
    summary = {"gpu": gpu is not None, "device": gpu, "steps": [asdict(r) for r in results]}
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.out}")
    bad = [r.name for r in results if r.status in ("failed", "timeout")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
