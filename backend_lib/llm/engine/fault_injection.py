"""TEST-ONLY: the one seam through which tests inject faults into a running engine.

Production code has no other test hook. The seam is a `FaultHook` on the output processor
(`LLMEngine.fault_injector`), called with the id of every request whose tokens a step records;
raising fails that request alone, as a real per-request fault would (the others and the engine
carry on). Tests in process set the hook directly; tests against a real tritonserver set the
environment variable FAULT_INJECTION_ENV, which makes the served llm fail every request whose
prompt contains its value (`PromptMarkerFaults`). Never set it in production.
"""

from __future__ import annotations

import os
from collections.abc import Callable

FAULT_INJECTION_ENV = "BACKEND_LIB_FAULT_INJECTION"
"""Prompts containing this variable's value fail inside the engine step (TEST-ONLY)."""

FaultHook = Callable[[str], None]
"""Called with a request id inside the step; raising fails that request."""

_FAULT_ID_PREFIX = "fault-"


class PromptMarkerFaults:
    """Fails, inside the engine step, each request whose prompt contains `marker`."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    @classmethod
    def from_environment(cls) -> PromptMarkerFaults | None:
        marker = os.environ.get(FAULT_INJECTION_ENV)
        return cls(marker) if marker else None

    def request_id(self, prompt: str, request_id: str) -> str:
        """The id to submit `prompt` under: marked when the prompt holds the marker."""
        return _FAULT_ID_PREFIX + request_id if self.marker in prompt else request_id

    def __call__(self, request_id: str) -> None:
        if request_id.startswith(_FAULT_ID_PREFIX):
            raise RuntimeError(f"injected fault (test hook {FAULT_INJECTION_ENV})")
