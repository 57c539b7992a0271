"""The model registry: which models tritonserver serves now, their kinds, limits and tokenizers.

The repository index is read over gRPC and cached for a short TTL (and re-read on a miss), so a
model loaded or unloaded in Triton appears or disappears without restarting the frontend. Each
served version's config and, for an llm, the facts it publishes (`contract.ModelFacts`: the
engine's max_model_len, the LoRA adapters its registry serves, its tool-call and reasoning
parsers) are asked once and kept while that version stays READY: the frontend recomputes no limit
of its own and reads no parser setting from config.pbtxt.

An llm serving LoRA adapters serves each as a model of its own, as vLLM does: under the adapter's
name (unless another model has that name) and always as `<llm>:<adapter>`; a request for it goes
to the llm with `lora_name` in its sampling parameters.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from backend_lib import contract
from backend_lib.checkpoint import resolve_model_path
from backend_lib.config import ConfigError, version_parameters
from backend_lib.contract import ModelKind, model_kind
from openai_frontend.errors import APIError, invalid_request, model_not_found
from openai_frontend.tokenization import ModelTokenizer, load_tokenizer
from openai_frontend.triton import TritonClient

log = logging.getLogger(__name__)


@dataclass
class ModelInfo:
    """One READY model version as the frontend serves it."""

    name: str
    version: str
    kind: ModelKind
    parameters: dict[str, str]
    model_dir: Path | None
    max_batch_size: int = 0
    facts: contract.ModelFacts = field(default_factory=contract.ModelFacts)
    """What this version published about itself (an llm's; empty for the others)."""
    created: int = field(default_factory=lambda: int(time.time()))
    lora_name: str | None = None
    """The LoRA adapter this served model is (None: the Triton model itself)."""
    parent: str | None = None
    """For an adapter: the Triton llm it runs on."""

    @property
    def triton_name(self) -> str:
        """The Triton model that serves requests for this model."""
        return self.parent or self.name

    def adapter(self, served_as: str, lora_name: str) -> ModelInfo:
        """This llm's LoRA adapter `lora_name`, served under the model id `served_as`."""
        return replace(self, name=served_as, lora_name=lora_name, parent=self.name)

    def lora_names(self) -> list[str]:
        """The adapters this llm's engine serves, as it published them."""
        return sorted(self.facts.lora_adapters) if self.parent is None else []

    @property
    def max_model_len(self) -> int | None:
        """The engine's max_model_len, as the llm published it (None for the other kinds)."""
        return self.facts.max_model_len

    @property
    def tool_call_parser(self) -> str | None:
        """The format of this llm's tool calls, as it published it (`contract.TOOL_CALL_PARSERS`;
        None: no parser, tool_choice "auto" is refused)."""
        return self.facts.tool_call_parser

    @property
    def reasoning_parser(self) -> str | None:
        """The format of this llm's reasoning, as it published it (`contract.REASONING_PARSERS`;
        None: its text is all content)."""
        return self.facts.reasoning_parser

    def checkpoint(self) -> Path:
        """The checkpoint directory, resolved as the backend does (`{version}`, relative paths,
        `package:` specs)."""
        if self.model_dir is None:
            raise invalid_request(
                f"the frontend was started without --model-repository, so it cannot read the "
                f"tokenizer of model `{self.name}`"
            )
        try:
            return resolve_model_path(self.parameters.get("model", ""), self.model_dir)
        except ConfigError as exc:
            raise APIError(500, str(exc), "internal_server_error") from None


class ModelRegistry:
    """The models tritonserver serves, refreshed from its repository index."""

    def __init__(
        self,
        triton: TritonClient,
        repository: Path | None,
        ttl_s: float = 2.0,
        chat_template: Path | None = None,
    ):
        self.triton, self.repository, self.ttl_s = triton, repository, ttl_s
        self.chat_template = chat_template
        self._models: dict[str, ModelInfo] = {}
        self._aliases: dict[str, ModelInfo] = {}
        """`<llm>:<adapter>` ids, also accepted where the adapter is listed under its own name."""
        self._configs: dict[tuple[str, str], dict[str, Any]] = {}
        self._facts: dict[tuple[str, str], contract.ModelFacts] = {}
        """Per (model, version): what it published; kept, like its config, while it is READY."""
        self._tokenizers: dict[tuple[str, str], ModelTokenizer] = {}
        self._refreshed_at = float("-inf")
        self._lock = asyncio.Lock()

    async def refresh(self, force: bool = False) -> None:
        async with self._lock:
            if not force and time.monotonic() - self._refreshed_at < self.ttl_s:
                return
            models: dict[str, ModelInfo] = {}
            index = await self.triton.repository_index()
            ready = {
                (entry["name"], str(entry.get("version", "")))
                for entry in index
                if entry.get("state") == "READY"
            }
            for cache in (self._configs, self._facts, self._tokenizers):
                for key in set(cache) - ready:  # unloaded: a reload may change what it says
                    del cache[key]
            for entry in index:
                if entry.get("state") != "READY":
                    continue
                name, version = entry["name"], str(entry.get("version", ""))
                current = models.get(name)
                if current is not None and _version_key(current.version) >= _version_key(version):
                    continue
                info = await self._describe(name, version)
                if info is not None:
                    models[name] = info
            self._models, self._aliases = _with_adapters(models)
            self._refreshed_at = time.monotonic()

    async def _describe(self, name: str, version: str) -> ModelInfo | None:
        key = (name, version)
        if key not in self._configs:
            self._configs[key] = await self.triton.model_config(name, version)
        config = self._configs[key]
        kind = model_kind(config)
        if kind is None:
            return None
        facts = contract.ModelFacts()
        declared = {item.get("name") for item in config.get("input", [])}
        if kind == "llm" and contract.DESCRIBE in declared:
            if key not in self._facts:
                try:
                    self._facts[key] = await self.triton.model_facts(name, version)
                except APIError as exc:  # not answering (yet): left out until it does
                    log.warning("model %s version %s: no facts: %s", name, version, exc.message)
                    return None
            facts = self._facts[key]
        parameters = version_parameters(config, version)
        model_dir = self.repository / name if self.repository is not None else None
        max_batch_size = int(config.get("max_batch_size", 0) or 0)
        return ModelInfo(name, version, kind, parameters, model_dir, max_batch_size, facts)

    async def list(self) -> list[ModelInfo]:
        await self.refresh()
        return sorted(self._models.values(), key=lambda m: m.name)

    async def get(self, name: str | None, kind: ModelKind | None) -> ModelInfo:
        """The model `name` (or the only model of `kind` when name is empty) serving `kind`
        (None: any kind, the only llm when name is empty)."""
        await self.refresh()
        if not name:
            return await self._only(kind or "llm")
        if name not in self._models and name not in self._aliases:
            await self.refresh(force=True)  # just loaded?
        info = self._models.get(name) or self._aliases.get(name)
        if info is None:
            raise model_not_found(name)
        if kind is not None and info.kind != kind:
            raise invalid_request(
                f"model `{name}` is a {info.kind} model; this endpoint needs a {kind} model",
                "model",
            )
        return info

    async def _only(self, kind: ModelKind) -> ModelInfo:
        found = [m for m in self._models.values() if m.kind == kind and m.parent is None]
        if len(found) != 1:
            names = ", ".join(sorted(m.name for m in found)) or "none"
            raise invalid_request(
                f"`model` is required: {len(found)} {kind} models are served ({names})", "model"
            )
        return found[0]

    def tokenizer(self, info: ModelInfo) -> ModelTokenizer:
        key = (info.triton_name, info.version)  # an adapter shares its llm's tokenizer
        if key not in self._tokenizers:
            override = self.chat_template if info.kind == "llm" else None
            self._tokenizers[key] = load_tokenizer(info.checkpoint(), override)
        return self._tokenizers[key]


def _with_adapters(
    models: dict[str, ModelInfo],
) -> tuple[dict[str, ModelInfo], dict[str, ModelInfo]]:
    """The models plus each llm's LoRA adapters (listed under their own names where no other
    model has them, else as `<llm>:<adapter>`), and every `<llm>:<adapter>` id."""
    served, aliases = dict(models), {}
    adapters = [(info, lora) for info in models.values() for lora in info.lora_names()]
    names = [lora for _, lora in adapters]
    for info, lora in adapters:
        qualified = f"{info.name}:{lora}"
        aliases[qualified] = info.adapter(qualified, lora)
        own_name = lora not in models and names.count(lora) == 1
        served[lora if own_name else qualified] = info.adapter(
            lora if own_name else qualified, lora
        )
    return served, aliases


def _version_key(version: str) -> tuple[int, str]:
    return (int(version), "") if version.isdigit() else (-1, version)
