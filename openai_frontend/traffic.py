"""Traffic splits between the versions of a model: which version serves a request for the plain
model name.

A split gives each version of a model a weight in percent (the weights sum to 100). A request
that carries a key (the `x-ab-key` header, else the body's `user`) always reaches the same version
for the same split: weighted rendezvous hashing, so changing the weights moves only the keys that
must move. A request without a key is assigned at random by weight. A version that is not ready
takes no traffic: its requests go to the ready versions of the split by weight (by the same hash
for a keyed request), or, with none of those ready, to the newest ready version; either way the
frontend counts them (`openai_frontend_split_rerouted_total`).

Splits come from the frontend's flags or its split file (re-read when it changes) and from the
admin endpoint (routes/admin.py); the newest change wins. Without a split a plain name reaches
the newest ready version, as before.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import math
import os
import random
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

AB_KEY_HEADER = "x-ab-key"
"""The request header whose value pins a client to one version of a split."""
VERSION_HEADER = "x-model-version"
"""The response header naming the Triton version that served the request."""
PINNED_ID = re.compile(r"^(?P<model>.+):(?P<version>[0-9]+)$")
"""A pinned model id: `<model>:<version>`, e.g. `llm:2` (versions are Triton's integers)."""


class SplitError(ValueError):
    """A split that cannot be applied; the message says why (the client gets a 400)."""


@dataclass(frozen=True)
class VersionSplit:
    """The weights of one model's versions."""

    weights: tuple[tuple[str, int], ...]
    """(version, percent) pairs, in the order given; the percents sum to 100."""

    @classmethod
    def parse(cls, model: str, weights: Any) -> VersionSplit:
        """`{"1": 90, "2": 10}` (or a list of pairs); SplitError for anything else."""
        items = weights.items() if isinstance(weights, Mapping) else weights
        try:
            pairs = [(str(version), weight) for version, weight in items]
        except (TypeError, ValueError):
            raise SplitError(f"split of `{model}`: expected {{version: percent}}") from None
        for version, weight in pairs:
            if not version.isdigit() or int(version) < 1:
                raise SplitError(f"split of `{model}`: version {version!r} is not a Triton version")
            if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= 100:
                raise SplitError(
                    f"split of `{model}`: the weight of version {version} must be an integer "
                    f"percent in 0..100, got {weight!r}"
                )
        if len({v for v, _ in pairs}) != len(pairs):
            raise SplitError(f"split of `{model}` names a version twice")
        total = sum(w for _, w in pairs)
        if total != 100:
            raise SplitError(f"split of `{model}`: the weights sum to {total}, not 100")
        return cls(tuple((str(int(v)), w) for v, w in pairs))

    @property
    def versions(self) -> list[str]:
        return [v for v, _ in self.weights]

    def as_dict(self) -> dict[str, int]:
        return dict(self.weights)


@dataclass(frozen=True)
class Assignment:
    """Where the split sent one request."""

    version: str
    rerouted_from: str | None = None
    """The version the split chose, when it was not ready and another served instead."""


def _unit_hash(key: str, version: str) -> float:
    """A uniform number in (0, 1) from (key, version), the same in every process."""
    digest = hashlib.blake2b(f"{version}\0{key}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 0.5) / 2.0**64


def _pick(weights: Iterable[tuple[str, int]], key: str | None, rng: random.Random) -> str | None:
    """A version by weight: the rendezvous winner for `key`, or a random draw without one."""
    positive = [(v, w) for v, w in weights if w > 0]
    if not positive:
        return None
    if key is None:
        return rng.choices([v for v, _ in positive], [w for _, w in positive])[0]
    # Weighted rendezvous: P(version wins) = its weight / the total, and a weight change only
    # moves the keys whose winner changed.
    return max(positive, key=lambda vw: -vw[1] / math.log(_unit_hash(key, vw[0])))[0]


def assign(
    split: VersionSplit,
    ready: Iterable[str],
    key: str | None,
    rng: random.Random,
) -> Assignment | None:
    """The version of `ready` that serves a request under `split` (module docstring); None when
    no version of the split is ready (the caller falls back to the newest ready one)."""
    ready_set = set(ready)
    chosen = _pick(split.weights, key, rng)
    if chosen is None:
        return None
    if chosen in ready_set:
        return Assignment(chosen)
    fallback = _pick([(v, w) for v, w in split.weights if v in ready_set], key, rng)
    return Assignment(fallback, rerouted_from=chosen) if fallback is not None else None


class TrafficSplits:
    """The current split of every model that has one, and where it came from."""

    def __init__(self, splits: Mapping[str, VersionSplit] | None = None, path: Path | None = None):
        self._splits: dict[str, VersionSplit] = dict(splits or {})
        self.path = path
        """The split file, re-read when its modification time changes (None: no file)."""
        self._file_stamp: tuple[int, int] | None = None
        self.rng = random.Random()
        if path is not None:
            self.reload_if_changed()

    def get(self, model: str) -> VersionSplit | None:
        return self._splits.get(model)

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {model: split.as_dict() for model, split in sorted(self._splits.items())}

    def set(self, model: str, split: VersionSplit) -> None:
        # One dict assignment: a request reads the old split or the new one, never a mix.
        self._splits = {**self._splits, model: split}

    def remove(self, model: str) -> bool:
        if model not in self._splits:
            return False
        self._splits = {m: s for m, s in self._splits.items() if m != model}
        return True

    def reload_if_changed(self) -> None:
        """Re-read the split file when it changed since the last read. A file that cannot be
        read or parsed keeps the splits in force (and is logged)."""
        if self.path is None:
            return
        try:
            stat = os.stat(self.path)
        except OSError as exc:
            if self._file_stamp is not None:
                log.error("traffic split file %s: %s; the current splits stay", self.path, exc)
            return
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._file_stamp:
            return
        self._file_stamp = stamp
        try:
            splits = read_split_file(self.path)
        except (OSError, SplitError) as exc:
            log.error("traffic split file %s: %s; the current splits stay", self.path, exc)
            return
        self._splits = dict(splits)
        log.info("traffic splits from %s: %s", self.path, self.snapshot())


def read_split_file(path: Path) -> dict[str, VersionSplit]:
    """A split file: JSON `{"splits": {"<model>": {"<version>": percent, ...}, ...}}`."""
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise SplitError(f"not valid JSON: {exc}") from None
    splits = document.get("splits") if isinstance(document, dict) else None
    if not isinstance(splits, dict):
        raise SplitError('expected {"splits": {"<model>": {"<version>": percent}}}')
    return {str(model): VersionSplit.parse(str(model), w) for model, w in splits.items()}


def parse_split_flag(value: str) -> tuple[str, VersionSplit]:
    """`llm=1:90,2:10` (the `--traffic-split` flag) -> ("llm", its split)."""
    model, sep, rest = value.partition("=")
    if not sep or not model:
        raise SplitError(f"expected <model>=<version>:<percent>,..., got {value!r}")
    pairs = []
    for part in rest.split(","):
        version, sep, weight = part.strip().partition(":")
        if not sep or not weight.strip().lstrip("-").isdigit():
            raise SplitError(f"split of `{model}`: expected <version>:<percent>, got {part!r}")
        pairs.append((version.strip(), int(weight)))
    return model, VersionSplit.parse(model, pairs)


@dataclass
class Routed:
    """What routing decided for the current HTTP request (the middleware reads it back for the
    response header and the per-version metrics)."""

    ab_key: str | None = None
    """The `x-ab-key` header's value, if the request had one."""
    model: str | None = None
    """The Triton model that served it."""
    version: str | None = None
    rerouted: list[tuple[str, str]] = field(default_factory=list)
    """(model, version) a split chose but that was not ready."""


CURRENT: contextvars.ContextVar[Routed | None] = contextvars.ContextVar("routed", default=None)
"""The current request's `Routed`, set by the frontend middleware (None outside a request)."""
