"""Start a real Prometheus server (Debian's `prometheus` package, installed by `make setup`) on a
free local port, scraping given targets and evaluating given rule files, and query it through its
HTTP API. Used by the tests that prove the chart's queries against live metrics."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tooling.child_process import die_with_parent
from tooling.tritonserver import free_port

INSTALL_HINT = "`make setup` installs Debian's `prometheus` package (as root, or through sudo)"


def prometheus_binary(name: str = "prometheus") -> str:
    """The path of `prometheus` (or `promtool`) on PATH; a clear error when it is missing."""
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found on PATH: {INSTALL_HINT}")
    return found


@dataclass
class ScrapeJob:
    """One scrape job: a metrics endpoint and the target labels Prometheus attaches to its series
    (e.g. `namespace` and `pod`, as Kubernetes service discovery would)."""

    name: str
    address: str
    """host:port of the metrics endpoint (path /metrics)."""
    labels: dict[str, str] = field(default_factory=dict)


class PrometheusServer:
    """A Prometheus process with its own temporary storage; use as a context manager."""

    def __init__(
        self,
        jobs: Sequence[ScrapeJob],
        rule_files: Sequence[Path] = (),
        scrape_interval_s: int = 1,
        evaluation_interval_s: int = 1,
        startup_timeout_s: float = 60.0,
    ):
        self.jobs, self.rule_files = list(jobs), [Path(p) for p in rule_files]
        self.scrape_interval_s, self.evaluation_interval_s = (
            scrape_interval_s,
            evaluation_interval_s,
        )
        self.startup_timeout_s = startup_timeout_s
        self.port = free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix="prometheus-"))
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict:
        return {
            "global": {
                "scrape_interval": f"{self.scrape_interval_s}s",
                "scrape_timeout": f"{self.scrape_interval_s}s",
                "evaluation_interval": f"{self.evaluation_interval_s}s",
            },
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": [
                {
                    "job_name": job.name,
                    "static_configs": [{"targets": [job.address], "labels": job.labels}],
                }
                for job in self.jobs
            ],
        }

    def start(self) -> PrometheusServer:
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(self.config()))
        self._log = open(self.workdir / "prometheus.log", "wb")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            [
                prometheus_binary(),
                f"--config.file={config_path}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"prometheus not ready after {self.startup_timeout_s}s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if hasattr(self, "_log"):
            self._log.close()
        shutil.rmtree(self.workdir / "data", ignore_errors=True)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, lines: int = 50) -> str:
        path = self.workdir / "prometheus.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # --- HTTP API ---------------------------------------------------------------------------

    def api(self, path: str, params: dict | None = None) -> dict | list:
        """GET /api/v1/<path>; the `data` of a success, else a ValueError with Prometheus's error."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=30) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise ValueError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query: the result vector (or a one-element list for a scalar)."""
        data = self.api("query", {"query": expr, **({"time": at} if at is not None else {})})
        return data["result"] if data["resultType"] in ("vector", "matrix") else [data["result"]]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """A range query (what a Grafana time-series panel sends): one entry per series."""
        data = self.api("query_range", {"query": expr, "start": start, "end": end, "step": step})
        return data["result"]

    def targets_up(self) -> bool:
        active = self.api("targets")["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)

    def wait_targets_up(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.targets_up():
            if time.monotonic() > deadline:
                raise TimeoutError(f"targets not up: {self.api('targets')['activeTargets']}")
            time.sleep(0.5)

    def rule_groups(self) -> list[dict]:
        return self.api("rules")["groups"]
