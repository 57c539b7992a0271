"""TritonServer.start on a stand-in server process: a start that dies of Triton 2.51's upstream
abort at load (UPSTREAM_LOAD_ABORT) is started again and comes up live; another server answering
on our port does not make ours live (it finds the port taken and starts again on others); any
other death at start is raised at once with the log."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from tooling.tritonserver import UPSTREAM_LOAD_ABORT, TritonServer

# argv: http port, metrics port, a marker file, how the first start dies ("abort" or "error"),
# the abort's text.
STAND_IN = textwrap.dedent(
    """
    import http.server, os, signal, sys
    port, metrics, marker, death, abort = sys.argv[1:]
    if death == "late":  # loads a while, then finds its port taken by another server
        import time
        time.sleep(1)
    elif death != "quiet" and not os.path.exists(marker):
        open(marker, "w").close()
        if death == "abort":
            print("terminate called after throwing an instance of '%s'" % abort, flush=True)
        else:
            print("error: creating server: Invalid argument", flush=True)
        os.kill(os.getpid(), signal.SIGABRT)

    class Live(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

    try:
        server = http.server.HTTPServer(("127.0.0.1", int(port)), Live)
    except OSError:
        print("error: creating server: Address already in use", flush=True)
        sys.exit(1)
    if death != "quiet":  # as with --log-info=false
        print("Started HTTPService at 0.0.0.0:%s" % port, flush=True)
        print("Started Metrics Service at 0.0.0.0:%s" % metrics, flush=True)
    server.serve_forever()
    """
)


class StandIn(TritonServer):
    def __init__(self, tmp_path: Path, death: str, extra_args=()):
        super().__init__(tmp_path, extra_args=extra_args, startup_timeout=30)
        self.script, self.marker, self.death = tmp_path / "stand_in.py", tmp_path / "died", death
        self.script.write_text(STAND_IN)
        self.spawns = 0

    def command(self) -> list[str]:
        self.spawns += 1
        ports = [str(self.http_port), str(self.metrics_port)]
        args = [*ports, str(self.marker), self.death, UPSTREAM_LOAD_ABORT]
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


def test_another_server_on_our_port_is_not_taken_for_ours(tmp_path):
    import http.server
    import threading

    class Live(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = StandIn(tmp_path, "late")
    other = http.server.HTTPServer(("127.0.0.1", server.http_port), Live)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    taken = server.http_port
    try:
        server.start()
        assert server.spawns == 2 and server.http_port != taken
        assert server.process.poll() is None
    finally:
        other.shutdown()
        server.stop()


def test_a_server_told_not_to_log_its_start_is_live_by_its_port(tmp_path):
    server = StandIn(tmp_path, "quiet", extra_args=["--log-info", "false"])
    try:
        server.start()
        assert server.spawns == 1 and server.process.poll() is None
    finally:
        server.stop()
