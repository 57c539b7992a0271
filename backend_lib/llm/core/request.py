"""EngineRequest: one generation request as it enters the engine, carried from the input
processor (validated, tokenized) through the scheduler's sequences to the outputs. A new
per-request field (priority, deadline, tenant, images, ...) is added here once."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from backend_lib.llm.core.multimodal import MultiModalFeature
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.multimodal.images import DecodedImage

DEFAULT_TENANT = "default"
"""The tenant of a request that names none and runs on the base model."""


@dataclass(frozen=True)
class EngineRequest:
    """What a caller asks the engine for; checked by `InputProcessor.prepare`."""

    request_id: str
    """Unique among the engine's unfinished requests."""
    prompt: str | None
    """The prompt text (None when `prompt_token_ids` is given)."""
    params: SamplingParams
    prompt_token_ids: Seq[int] | None = None
    """The prompt as token ids, used as given (no tokenization); None: tokenize `prompt`."""
    arrival_time: float | None = None
    """Seconds on `time.monotonic()`; None: the time it is prepared."""
    lora_name: str | None = None
    """The LoRA adapter it runs under (None: the base model)."""
    deadline: float | None = None
    """When it must have finished, in seconds on `time.monotonic()` (None: no deadline); past it,
    the engine ends it with deadline_exceeded (engine/deadlines.py)."""
    priority: int = 0
    """Scheduling priority, lower first (vLLM's `priority`); only `scheduling_policy: priority`
    takes a value other than 0."""
    tenant: str | None = None
    """Who it is served for, as the frontend passes it through (the API key's name, or the
    request's `user`); None: its LoRA adapter's, else the default tenant (`tenant_key`)."""
    images: Seq[DecodedImage] = ()
    """The images of the prompt, in the order of its image placeholders (decoded and bounded by
    the caller: backend_lib/multimodal/images.py); only a vision-language model takes any."""
    mm_features: Seq[MultiModalFeature] = ()
    """Filled by the input processor from `images`: each image's placeholder range in the
    tokenized prompt, its digest and its processed tensors (core/multimodal.py)."""

    @property
    def tenant_key(self) -> str:
        """The tenant fair share and the per-tenant limits count it under (core/tenants.py):
        `tenant`, else the LoRA adapter's name, else DEFAULT_TENANT."""
        return self.tenant or self.lora_name or DEFAULT_TENANT
