"""A step's image embeddings: which flattened rows are image placeholders, and the vision
encoder's output rows that replace their token embeddings.

Each image is encoded once, whole, the first time a step holds any of its placeholder rows, and
kept in the `EncoderCache` (by image digest, vLLM's encoder cache), so a prompt whose image spans
several prefill chunks, a preempted prompt computed again, or a repeated image reuse its output.
A step takes from each image only the rows its chunk covers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from backend_lib.llm.core.multimodal import MultiModalFeature


@dataclass(frozen=True)
class MultiModalEmbeds:
    """The rows of a flattened step that take image embeddings."""

    rows: torch.Tensor
    """int64 [K]: flattened row indices (placeholder tokens)."""
    values: torch.Tensor
    """[K, hidden_size], the model's dtype: each row's embedding, in `rows` order."""


@dataclass(frozen=True)
class ImageSlice:
    """The part of one image a step's chunk covers."""

    feature: MultiModalFeature
    first: int
    """First of the image's placeholder rows in the chunk (0-based within the image)."""
    stop: int
    """One past the last."""
    row: int
    """The flattened row of `first`."""


def image_slices(
    features_of: Sequence[Sequence[MultiModalFeature]], starts: Sequence[int], lens: Sequence[int]
) -> list[ImageSlice]:
    """The image rows of a flattened step whose sequence i (in row order) computes positions
    [starts[i], starts[i] + lens[i]) with images `features_of[i]`."""
    slices, row = [], 0
    for features, start, length in zip(features_of, starts, lens, strict=True):
        end = start + length
        for f in features:
            lo, hi = max(start, f.offset), min(end, f.end)
            if lo < hi:
                slices.append(ImageSlice(f, lo - f.offset, hi - f.offset, row + lo - start))
        row += length
    return slices


def visible_until(
    slices: list[ImageSlice], starts: Sequence[int], lens: Sequence[int]
) -> np.ndarray | None:
    """int32 [T]: the last key position each row of the step sees, its own position or, in a
    bidirectional image, the image's last; None when no row of the step is in such an image."""
    both_ways = [s for s in slices if s.feature.bidirectional]
    if not both_ways:
        return None
    limits = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens, strict=True)])
    for s in both_ways:
        limits[s.row : s.row + s.stop - s.first] = s.feature.end - 1
    return limits.astype(np.int32)


class EncoderCache:
    """Encoder outputs [length, hidden_size] by image digest, least recently used dropped first
    once they hold more than `capacity` rows in all (an image larger than that is not kept)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._rows = 0
        self.hits = 0
        """Images a step needed that were not encoded for it: found here, or encoded for another
        prompt of the same step."""
        self.misses = 0
        """Images encoded because they were not."""

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, digest: bytes) -> torch.Tensor | None:
        value = self._entries.get(digest)
        if value is not None:
            self._entries.move_to_end(digest)
        return value

    def put(self, digest: bytes, value: torch.Tensor) -> None:
        if digest in self._entries or len(value) > self.capacity:
            return
        self._entries[digest] = value
        self._rows += len(value)
        while self._rows > self.capacity:
            _, dropped = self._entries.popitem(last=False)
            self._rows -= len(dropped)


Encode = Callable[[list[Mapping[str, Any]]], list[torch.Tensor]]
"""The model's vision encoder: each image's processed tensors (`MultiModalFeature.data`) -> its
placeholder embeddings [tokens, hidden_size], in one call."""


def step_embeds(
    slices: list[ImageSlice], encode: Encode, cache: EncoderCache, device: torch.device
) -> MultiModalEmbeds | None:
    """The step's placeholder rows and their embeddings, encoding (in one call) the images the
    cache lacks; None for a step without image rows."""
    if not slices:
        return None
    outputs = _encoder_outputs([s.feature for s in slices], encode, cache, device)
    rows = torch.cat([torch.arange(s.row, s.row + s.stop - s.first) for s in slices])
    values = torch.cat([outputs[s.feature.digest][s.first : s.stop] for s in slices])
    return MultiModalEmbeds(rows.to(device), values)


def _encoder_outputs(
    features: list[MultiModalFeature], encode: Encode, cache: EncoderCache, device: torch.device
) -> dict[bytes, torch.Tensor]:
    """Each image's whole encoder output by digest (this step's, whatever the cache keeps)."""
    outputs: dict[bytes, torch.Tensor] = {}
    missing: dict[bytes, MultiModalFeature] = {}
    for f in features:
        if f.digest in outputs or f.digest in missing:
            cache.hits += 1  # another prompt of this step shows the same image
            continue
        cached = cache.get(f.digest)
        if cached is not None:
            cache.hits += 1
            outputs[f.digest] = cached
        else:
            missing[f.digest] = f
    cache.misses += len(missing)
    if missing:
        # The processor's tensors are made on the host: the tower takes them on its device.
        encoded = encode([_on(f.data, device) for f in missing.values()])
        for f, rows in zip(missing.values(), encoded, strict=True):
            if len(rows) != f.length:
                raise ValueError(
                    f"an image encoded to {len(rows)} rows for {f.length} placeholder tokens"
                )
            outputs[f.digest] = rows
            cache.put(f.digest, rows)
    return outputs


def _on(data: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """An image's processed tensors on `device` (other values as they are)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in data.items()}
