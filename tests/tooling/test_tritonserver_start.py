"""TritonServer.start on a stand-in server process: a start that dies of Triton 2.51's upstream
abort at load (UPSTREAM_LOAD_ABORT) is started again and comes up live; any other death at start
is raised at once with the log."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from tooling.tritonserver import UPSTREAM_LOAD_ABORT, TritonServer

# argv: http port, a marker file, how the first start dies ("abort" or "error").
STAND_IN = textwrap.dedent(
    """
    import http.server, os, signal, sys
    port, marker, death = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if not os.path.exists(marker):
        open(marker, "w").close()
        if death == "abort":
            print("terminate called after throwing an instance of '%s'" % sys.argv[4], flush=True)
        else:
            print("error: creating server: Invalid argument", flush=True)
        os.kill(os.getpid(), signal.SIGABRT)

    class Live(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

    http.server.HTTPServer(("127.0.0.1", port), Live).serve_forever()
    """
)


class StandIn(TritonServer):
    def __init__(self, tmp_path: Path, death: str):
        super().__init__(tmp_path, startup_timeout=30)
        self.script, self.marker, self.death = tmp_path / "stand_in.py", tmp_path / "died", death
        self.script.write_text(STAND_IN)
        self.spawns = 0

    def command(self) -> list[str]:
        self.spawns += 1
        args = [str(self.http_port), str(self.marker), self.death, UPSTREAM_LOAD_ABORT]
        return [sys.executable, str(self.script), *args]


def test_a_start_that_dies_of_the_upstream_abort_is_started_again(tmp_path):
    server = StandIn(tmp_path, "abort")
    try:
        server.start()
        assert server.spawns == 2 and server.process.poll() is None
        assert UPSTREAM_LOAD_ABORT in server.log_text()
    finally:
        server.stop()


def test_any_other_death_at_start_is_raised_with_the_log(tmp_path):
    server = StandIn(tmp_path, "error")
    with pytest.raises(RuntimeError, match="Invalid argument"):
        server.start()
    assert server.spawns == 1
    server.stop()
