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

Every READY version is served: under the pinned id `<model>:<version>` (e.g. `llm:2`), and the
plain name reaches the version its traffic split assigns (openai_frontend/traffic.py), or the
newest one without a split. An adapter follows its llm's split.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from backend_lib import contract
from backend_lib.checkpoint import resolve_model_path
from backend_lib.config import ConfigError, version_parameters
from backend_lib.contract import ModelKind, model_kind
from openai_frontend.errors import APIError, invalid_request, model_not_found
from openai_frontend.metrics import FrontendMetrics
from openai_frontend.tokenization import ModelTokenizer, load_tokenizer
from openai_frontend.traffic import CURRENT, PINNED_ID, TrafficSplits, assign
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
    sparse: bool = False
    """An embedding model serving sparse vectors (`contract.is_sparse_embedding`: /embed_sparse)."""

    @property
    def served_id(self) -> str:
        """The id a response names as its `model`: the pinned `<model>:<version>` of the version
        that served it, or an adapter's own id."""
        return (
            self.name
            if self.parent is not None or not self.version
            else f"{self.name}:{self.version}"
        )

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
            return resolve_model_path(
                self.parameters.get("model", ""),
                self.model_dir,
                self.parameters.get("gguf_file", ""),
            )
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
        splits: TrafficSplits | None = None,
        metrics: FrontendMetrics | None = None,
    ):
        self.triton, self.repository, self.ttl_s = triton, repository, ttl_s
        self.chat_template = chat_template
        self.splits = splits if splits is not None else TrafficSplits()
        self.metrics = metrics
        self._models: dict[str, ModelInfo] = {}
        """The newest READY version of each model, and the adapters (the listed ids)."""
        self._versions: dict[str, dict[str, ModelInfo]] = {}
        """Every READY version of each Triton model, by version."""
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
            self.splits.reload_if_changed()
            versions: dict[str, dict[str, ModelInfo]] = {}
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
                info = await self._describe(name, version)
                if info is not None:
                    versions.setdefault(name, {})[version] = info
            newest = {
                name: max(by_version.values(), key=lambda m: _version_key(m.version))
                for name, by_version in versions.items()
            }
            self._versions = versions
            self._models, self._aliases = _with_adapters(newest)
            self._refreshed_at = time.monotonic()
            self.publish_splits()

    def publish_splits(self) -> None:
        """Export the splits in force as metrics (after a refresh, which may re-read the split
        file, and after an admin change)."""
        if self.metrics is not None:
            self.metrics.set_splits(self.splits.snapshot())

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
        sparse = contract.is_sparse_embedding(config)
        return ModelInfo(
            name, version, kind, parameters, model_dir, max_batch_size, facts, sparse=sparse
        )

    async def list(self) -> list[ModelInfo]:
        """The listed models (newest versions and adapters), then every version's pinned id."""
        await self.refresh()
        listed = sorted(self._models.values(), key=lambda m: m.name)
        pinned = [
            replace(info, name=f"{name}:{version}")
            for name, by_version in sorted(self._versions.items())
            for version, info in sorted(by_version.items(), key=lambda vi: _version_key(vi[0]))
        ]
        return listed + [p for p in pinned if p.name not in self._models]

    def ready_versions(self, name: str) -> list[str]:
        """The READY versions of Triton model `name` as last read, oldest first."""
        return sorted(self._versions.get(name, {}), key=_version_key)

    async def get(
        self,
        name: str | None,
        kind: ModelKind | None,
        key: str | None = None,
        sparse: bool | None = None,
    ) -> ModelInfo:
        """The model `name` (or the only model of `kind` when name is empty) serving `kind`
        (None: any kind, the only llm when name is empty), in the version that serves this
        request: the pinned one of `<model>:<version>`, else the split's choice for `key` (the
        `x-ab-key` header wins over it), else the newest. `sparse` True or False: an embedding
        model serving sparse or dense vectors (None: either)."""
        await self.refresh()
        if not name:
            info = self._route(await self._only(kind or "llm", sparse), key)
        else:
            info = await self._lookup(name, key)
        if kind is not None and info.kind != kind:
            raise invalid_request(
                f"model `{name}` is a {info.kind} model; this endpoint needs a {kind} model",
                "model",
            )
        if sparse is not None and info.sparse != sparse:
            endpoints = "/embed_sparse" if info.sparse else "/v1/embeddings or /embed"
            raise invalid_request(
                f"model `{info.name}` serves {_vectors(info.sparse)} embeddings, which this "
                f"endpoint does not: call {endpoints}",
                "model",
            )
        return self._record(info)

    def rerouter(
        self, name: str | None, kind: ModelKind | None, key: str | None = None
    ) -> Callable[[], Awaitable[ModelInfo | None]] | None:
        """For a request `get` routed (not a pinned id): a call that re-reads the index and routes
        it again, for when its version turns out gone (None for a pinned id: that version or
        nothing)."""
        if name and name not in self._models and name not in self._aliases:
            return None

        async def reroute() -> ModelInfo | None:
            await self.refresh(force=True)
            try:
                return await self.get(name, kind, key)
            except APIError:
                return None

        return reroute

    async def _lookup(self, name: str, key: str | None) -> ModelInfo:
        if name not in self._models and name not in self._aliases:
            await self.refresh(force=True)  # just loaded?
        info = self._models.get(name) or self._aliases.get(name)
        if info is not None:
            return self._route(info, key)
        pinned = PINNED_ID.match(name)
        version_info = None
        if pinned is not None:
            version_info = self._versions.get(pinned["model"], {}).get(pinned["version"])
        if version_info is None:
            raise model_not_found(name)
        return version_info

    def _route(self, info: ModelInfo, key: str | None) -> ModelInfo:
        """`info` (a newest version or an adapter) in the version its llm's split assigns."""
        base = info.triton_name
        split = self.splits.get(base)
        if split is None:
            return info
        routed = CURRENT.get()
        if routed is not None and routed.ab_key:
            key = routed.ab_key
        assignment = assign(split, self.ready_versions(base), key, self.splits.rng)
        if assignment is None:  # none of the split's versions is ready: the newest serves
            if routed is not None:
                routed.rerouted.extend((base, v) for v in split.versions)
            return info
        if assignment.rerouted_from is not None and routed is not None:
            routed.rerouted.append((base, assignment.rerouted_from))
        chosen = self._versions[base][assignment.version]
        if info.parent is None:
            return chosen
        return chosen.adapter(info.name, info.lora_name or "")

    @staticmethod
    def _record(info: ModelInfo) -> ModelInfo:
        routed = CURRENT.get()
        if routed is not None:
            routed.model, routed.version = info.triton_name, info.version
        return info

    async def _only(self, kind: ModelKind, sparse: bool | None = None) -> ModelInfo:
        found = [
            m
            for m in self._models.values()
            if m.kind == kind and m.parent is None and (sparse is None or m.sparse == sparse)
        ]
        if len(found) != 1:
            names = ", ".join(sorted(m.name for m in found)) or "none"
            what = kind if sparse is None else f"{_vectors(sparse)} {kind}"
            raise invalid_request(
                f"`model` is required: {len(found)} {what} models are served ({names})", "model"
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


def _vectors(sparse: bool) -> str:
    return "sparse" if sparse else "dense"


def _version_key(version: str) -> tuple[int, str]:
    return (int(version), "") if version.isdigit() else (-1, version)
