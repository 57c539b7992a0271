"""KVEventsConfig: the `kv_events_config` parameter of an LLM's config.pbtxt, parsed and checked.

The value is a JSON object with vLLM's field names (`vllm.config.KVEventsConfig`), for example
`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}`. Empty means no events. Every problem
raises `ConfigError` naming `kv_events_config.<field>`, so a bad value fails only that model's load.

`endpoint`, `replay_endpoint` and `topic` may name environment variables as `${NAME}`, replaced
when the model loads: one config.pbtxt then serves every pod of a Deployment, each publishing
under its own topic (llm-d's `kv@${POD_IP}@<model>`, the pod's IP from the downward API) to an
endpoint the chart sets (`${KV_EVENTS_ENDPOINT}`). A variable that is not set fails the load.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, fields
from typing import Any

from backend_lib.config import ConfigError, require

PARAMETER = "kv_events_config"
ENVIRONMENT_FIELDS = ("endpoint", "replay_endpoint", "topic")
"""The fields where `${NAME}` names an environment variable."""
_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
PUBLISHERS = ("null", "zmq")
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    """Where the engine's KV cache events go (core/kv_events.py has their format)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    """"zmq": a ZeroMQ PUB socket; "null": none (the default unless events are enabled, as in
    vLLM, where enabling them picks zmq)."""
    endpoint: str = "tcp://*:5557"
    """The PUB socket: bound when it has a wildcard host (`*`, `::`) or is ipc/inproc, else
    connected (a remote collector)."""
    replay_endpoint: str | None = None
    """A ROUTER socket (bound) where a subscriber that missed batches asks for them again."""
    buffer_steps: int = 10_000
    """Batches kept for replay."""
    hwm: int = 100_000
    """The PUB socket's high-water mark (messages queued per slow subscriber)."""
    max_queue_size: int = 100_000
    """Batches waiting for the publisher thread; past it a batch is dropped (and counted), never
    the engine step held."""
    topic: str = ""
    use_int_block_hashes: bool = True
    """Block hashes on the wire as vLLM sends them by default (its
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, what llm-d and Dynamo read): the low 64 bits of each
    32-byte digest as an integer; false: the 32 bytes (msgpack bin)."""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the parameter's JSON value; "" means no events."""
        if not text.strip():
            return cls()
        try:
            values = json.loads(text)
        except ValueError as exc:
            raise ConfigError(PARAMETER, text, f"not valid JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ConfigError(PARAMETER, text, "must be a JSON object")
        known = {f.name for f in fields(cls)}
        for key in values:
            require(
                key in known, f"{PARAMETER}.{key}", values[key], f"unknown; one of {sorted(known)}"
            )
        if values.get("enable_kv_cache_events") and "publisher" not in values:
            values["publisher"] = "zmq"  # as vLLM: enabling events picks its publisher
        for key in ENVIRONMENT_FIELDS:
            if isinstance(values.get(key), str):
                values[key] = _expand(key, values[key])
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        _check_type("enable_kv_cache_events", self.enable_kv_cache_events, bool)
        require(
            self.publisher in PUBLISHERS,
            f"{PARAMETER}.publisher",
            self.publisher,
            f"must be one of {PUBLISHERS}",
        )
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            _check_type(name, value, str)
            require(
                value.startswith(ENDPOINT_SCHEMES),
                f"{PARAMETER}.{name}",
                value,
                f"must be a ZeroMQ endpoint ({', '.join(ENDPOINT_SCHEMES)})",
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            _check_type(name, value, int)
            require(value >= 1, f"{PARAMETER}.{name}", value, "must be >= 1")
        _check_type("topic", self.topic, str)
        _check_type("use_int_block_hashes", self.use_int_block_hashes, bool)


def _expand(name: str, value: str) -> str:
    """`value` with each `${NAME}` replaced by that environment variable."""

    def variable(match: re.Match) -> str:
        found = os.environ.get(match.group(1))
        require(
            found is not None,
            f"{PARAMETER}.{name}",
            value,
            f"names the environment variable {match.group(1)}, which is not set",
        )
        return found

    return _VARIABLE.sub(variable, value)


def _check_type(name: str, value: Any, kind: type) -> None:
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    require(ok, f"{PARAMETER}.{name}", value, f"must be a JSON {kind.__name__}")
