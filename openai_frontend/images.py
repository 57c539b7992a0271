"""The images of a request: their URLs read under the frontend's fetch policy (data: URLs always,
file:// under `--allowed-local-media-path`, http(s) with `--allow-remote-media`), counted and
bounded by what the llm published (`ModelFacts.max_images`, `max_image_bytes`): the encoded
bytes go to the llm's `image` input, which decodes them within its own limits."""

from __future__ import annotations

import asyncio

from backend_lib.errors import InputError
from backend_lib.multimodal.image_sources import ImageFetchPolicy, read_image_url
from openai_frontend.discovery import ModelInfo
from openai_frontend.errors import invalid_request


async def read_images(urls: list[str], info: ModelInfo, policy: ImageFetchPolicy) -> list[bytes]:
    """Each image URL's encoded bytes, in order (files and remote reads off the event loop);
    a 400 naming what is wrong: a model that takes no images, too many, a refused URL."""
    if not urls:
        return []
    facts = info.facts
    if facts.max_images == 0:
        raise invalid_request(f"model `{info.name}` takes no images (it is not a vision model)")
    if len(urls) > facts.max_images:
        raise invalid_request(
            f"the request has {len(urls)} images; model `{info.name}` takes at most "
            f"{facts.max_images} per prompt"
        )
    try:
        return await asyncio.gather(
            *(asyncio.to_thread(read_image_url, u, policy, facts.max_image_bytes) for u in urls)
        )
    except InputError as exc:
        raise invalid_request(str(exc)) from None
