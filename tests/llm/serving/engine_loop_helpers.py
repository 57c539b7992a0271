"""EngineLoop test helpers: read a request's stream to its end, with a bound on every wait."""

from __future__ import annotations

TIMEOUT = 60  # seconds; a hang fails the test instead of blocking the suite


def collect(stream) -> list:
    """Every output of `stream` up to and including the finished one."""
    outputs = []
    while True:
        outputs.append(stream.get(timeout=TIMEOUT))
        if outputs[-1].finished:
            return outputs
