"""Constraints that are costly to compile, for the tests of compilation off the engine's path.

xgrammar turns a schema string `pattern` into a grammar before compiling it, and alternations of
overlapping pieces under a long repeat make that conversion quadratic: `^(x|y|xy|yx){1,N}$`
takes about 0.3 CPU seconds at N=800, 2 at N=2000 and 10 at N=5000 (AMD EPYC Zen 3), most of it
in the conversion (the token-mask compile itself is milliseconds). Each call gives a pattern of its own letters, so no two share
a cache entry.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

SLOW_N = 2000
"""A few seconds of compile: long beside a short free request, well inside the default 10 s
budget."""
STUCK_N = 6000
"""Far past a 1 s timeout."""
_PAIRS = itertools.count(1)
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def costly_pattern(n: int) -> str:
    """`^(a|b|ab|ba){1,n}$`-shaped, over letters no earlier call used (a new cache key)."""
    i = next(_PAIRS)
    a, b = _LETTERS[(2 * i) % 26], _LETTERS[(2 * i + 1) % 26]
    return f"^({a}|{b}|{a}{b}|{b}{a}){{1,{n + i // 13}}}$"


def costly_schema(n: int = SLOW_N) -> dict[str, Any]:
    """A JSON schema: one string whose `pattern` is `costly_pattern(n)`."""
    return {"type": "string", "pattern": costly_pattern(n)}


def process_gone(pid: int) -> bool:
    """The process has exited (a zombie left for its reaper counts as gone)."""
    status = Path(f"/proc/{pid}/status")
    try:
        text = status.read_text()
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    return "\nState:\tZ" in text or "\nState:\tX" in text
