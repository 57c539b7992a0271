"""The adapters one engine may serve: a name -> directory list (Triton's vLLM backend reads it from
`<version>/multi_lora.json`), ids, and an LRU cache of loaded adapters in host memory.

Adapters load on first use, on the requesting thread (`request`), so a bad directory fails only
the requests naming it. Unknown names and a disabled LoRA get the vLLM backend's error messages.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

from backend_lib.config import ConfigError
from backend_lib.errors import InputError
from backend_lib.llm.lora.adapter import LoRAAdapter, LoRAModelSpec, load_adapter
from backend_lib.llm.lora.request import LoRARequest

MULTI_LORA_FILE = "multi_lora.json"
LORA_DISABLED_ERROR = "LoRA feature is not enabled."
"""The vLLM backend's message for a `lora_name` sent to a model without LoRA."""


def read_multi_lora(version_dir: Path, model_dir: Path) -> dict[str, Path]:
    """`<version_dir>/multi_lora.json` ({"name": "path"}); relative paths are taken from
    `model_dir` (the model's directory, as for the `model` parameter). ConfigError when missing
    or malformed."""
    path = Path(version_dir) / MULTI_LORA_FILE
    if not path.is_file():
        raise ConfigError(
            "enable_lora", "true", f"cannot find {path}: list the adapters there as {{name: path}}"
        )
    try:
        listing = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError("enable_lora", "true", f"{path} is not valid JSON: {exc}") from None
    if not isinstance(listing, dict) or not all(
        isinstance(k, str) and k and isinstance(v, str) and v for k, v in listing.items()
    ):
        raise ConfigError("enable_lora", "true", f"{path} must map adapter names to paths")
    numeric = sorted(name for name in listing if name.isdigit())
    if numeric:
        # `<llm>:<digits>` is the frontend's pinned version id; an adapter there would shadow it.
        raise ConfigError(
            "enable_lora",
            "true",
            f"{path}: adapter names must not be all digits ({', '.join(numeric)}): "
            "`<model>:<number>` names a model version",
        )
    return {name: Path(model_dir) / value for name, value in listing.items()}


class LoRARegistry:
    """Named adapters of one engine; thread-safe (requests are prepared on callers' threads)."""

    def __init__(
        self,
        modules: Mapping[str, str | Path],
        spec: LoRAModelSpec,
        max_lora_rank: int,
        max_cpu_loras: int,
    ) -> None:
        """`modules`: name -> adapter directory; `max_cpu_loras`: adapters kept loaded in host
        memory (least recently requested evicted first; requests in flight keep theirs)."""
        self.paths = {name: Path(path) for name, path in modules.items()}
        self.ids = {name: index for index, name in enumerate(self.paths, start=1)}
        self.spec, self.max_lora_rank, self.max_cpu_loras = spec, max_lora_rank, max_cpu_loras
        self._cache: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()
        self.load_seconds: list[float] = []
        """Time of each adapter load from disk (cache misses), in seconds."""

    @property
    def names(self) -> list[str]:
        return list(self.paths)

    def request(self, name: str) -> LoRARequest:
        """The adapter `name`, loaded (from the cache or disk). InputError for an unknown name
        (the vLLM backend's message), LoRALoadError (an InputError) for a bad directory."""
        if name not in self.paths:
            raise InputError(f"LoRA {name} is not supported, we currently support {self.names}")
        with self._lock:
            adapter = self._cache.get(name)
            if adapter is None:
                started = time.perf_counter()
                adapter = load_adapter(name, self.paths[name], self.spec, self.max_lora_rank)
                self.load_seconds.append(time.perf_counter() - started)
                self._cache[name] = adapter
                while len(self._cache) > self.max_cpu_loras:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(name)
        return LoRARequest(name, self.ids[name], str(self.paths[name]), adapter)

    def cached_names(self) -> list[str]:
        """Adapters in host memory, least recently requested first."""
        with self._lock:
            return list(self._cache)
