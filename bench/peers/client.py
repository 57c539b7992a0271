"""Driving a peer worker (bench.peers.worker, in `.venv-peers`) from a benchmark's process.

The peers cannot share the benchmark's process (their environment pins another transformers): the
closest is a worker process given the same thread count (OMP_NUM_THREADS, and each runtime's own
setting), fed the same token ids or texts over a pipe while the benchmark's process waits, so the
two never run at once. The worker times each run itself.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess

import numpy as np

from bench.peers import env
from tooling.child_process import die_with_parent


class PeerError(RuntimeError):
    """A request the worker could not carry out (its message), or a worker that died."""


AMX_CAP = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
"""oneDNN's instruction sets capped below AMX (OpenVINO reads oneDNN's variable)."""


def openvino_isa_cap(threads: int) -> dict[str, str]:
    """The worker's environment for OpenVINO at `threads`: on a CPU with AMX at one thread, oneDNN
    capped below AMX. There OpenVINO 2026.4's CPU plugin dies with SIGFPE in bfloat16 (its
    continuous batching and its LLMPipeline alike; at two threads, or with AMX capped, it runs),
    seen on this project's Sapphire Rapids VMs; the cap costs it AMX's prefill GEMMs only (a
    one-row decode GEMV does not use AMX)."""
    if threads != 1 or "amx_bf16" not in env.cpu_flags():
        return {}
    return dict(AMX_CAP)


class PeerWorker:
    """One worker process running its peers with `threads` threads; a context manager."""

    def __init__(self, threads: int):
        self.threads = threads
        self.cpu_seconds = 0.0
        """The CPU seconds (all the worker's threads) of the latest generate, encode or score."""
        self.latencies: list[dict] | None = None
        """The latest generate's per-request {"ttft", "tpot", "tokens"} (seconds), from systems
        that time each token's arrival; else None."""
        thread_vars = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
        environ = {**os.environ, **dict.fromkeys(thread_vars, str(threads))}
        environ["PYTHONPATH"] = str(env.REPO_ROOT)
        environ.update(openvino_isa_cap(threads))
        self.proc = subprocess.Popen(
            [str(env.python()), "-m", "bench.peers.worker"],
            cwd=env.REPO_ROOT,
            env=environ,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=die_with_parent(),
        )

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, op: str, **request) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **request}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError as exc:
            raise PeerError(f"the peer worker exited ({self.proc.poll()})") from exc
        line = self.proc.stdout.readline()
        if not line:
            raise PeerError(f"the peer worker exited ({self.proc.wait()})")
        answer = json.loads(line)
        if not answer.pop("ok"):
            raise PeerError(answer["error"])
        return answer

    def load(self, system: str, path, dtype: str, **settings) -> dict:
        """Load `system` from `path` in `dtype` with this worker's threads; its settings."""
        answer = self.call(
            "load",
            system=system,
            path=str(path),
            threads=self.threads,
            dtype=dtype,
            settings=settings,
        )
        return answer["info"]

    def generate(
        self, system: str, prompts: list[list[int]], max_tokens: list[int], outputs: bool = True
    ) -> tuple[list[list[int]] | None, float]:
        """Greedy token ids (when `outputs`) and the seconds of the peer's generate call."""
        answer = self.call(
            "generate", system=system, prompts=prompts, max_tokens=max_tokens, outputs=outputs
        )
        self.cpu_seconds = answer["cpu_seconds"]
        self.latencies = answer.get("latencies")
        return answer["outputs"], answer["seconds"]

    def score(self, system: str, windows: list[list[int]]) -> tuple[list[float], float]:
        """Each window's summed negative log-likelihood of its tokens after the first (a system
        that scores: llama_cpp_scorer), and the seconds the peer took."""
        answer = self.call("score", system=system, windows=windows)
        self.cpu_seconds = answer["cpu_seconds"]
        return answer["nll"], answer["seconds"]

    def encode(
        self, system: str, texts: list[str] | None = None, outputs: bool = True
    ) -> tuple[np.ndarray | None, float]:
        """Embeddings (when `outputs`) of `texts` (None: the previous ones) and the seconds."""
        answer = self.call("encode", system=system, texts=texts, outputs=outputs)
        self.cpu_seconds = answer["cpu_seconds"]
        if not outputs:
            return None, answer["seconds"]
        data = np.frombuffer(base64.b64decode(answer["embeddings"]), dtype=np.float32)
        return data.reshape(answer["shape"]), answer["seconds"]

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> PeerWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
