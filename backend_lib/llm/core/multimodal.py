"""Images in a prompt, as the engine carries them: where each one's placeholder tokens lie, what
identifies it, and the processed tensors the vision encoder takes (opaque here).

The core uses the rest only: a KV block whose tokens overlap an image's placeholders hashes
that image's digest too (`block_extra_key`), so two prompts with equal text but different images
never share a prefix block, while a repeated image does; and an image whose tokens attend to each
other both ways (Gemma 3's) is computed in one prefill chunk (`chunk_end`), as vLLM's
`disable_chunked_mm_input` does: a chunk ending inside it would attend to image tokens not yet
computed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MultiModalFeature:
    """One image of a prompt (vLLM's `MultiModalFeatureSpec`)."""

    digest: bytes
    """SHA-256 of the encoded image, 32 bytes: its prefix-cache and encoder-cache identity."""
    offset: int
    """Position of its first placeholder token in the prompt."""
    length: int
    """Placeholder tokens it fills: the rows of its encoder output."""
    data: Mapping[str, Any]
    """The processor's tensors for this image alone (e.g. pixel_values [1, 3, H, W] float32),
    what the model's vision encoder takes; never read by the core."""
    bidirectional: bool = False
    """Its placeholder tokens attend to each other both ways (Gemma 3), not causally: it is
    computed whole in one step."""

    @property
    def end(self) -> int:
        """One past its last placeholder position."""
        return self.offset + self.length


def block_extra_key(features: Sequence[MultiModalFeature], start: int, end: int) -> bytes:
    """What a block of positions [start, end) hashes beside its tokens: the digest of every image
    whose placeholders overlap it, with where that image starts relative to the block (so a shift
    of the same image is a different block); b"" for a block of text only."""
    key = b""
    for feature in features:
        if feature.offset < end and feature.end > start:
            key += feature.digest + (feature.offset - start).to_bytes(8, "little", signed=True)
    return key


def chunk_end(features: Sequence[MultiModalFeature], start: int, end: int) -> int:
    """Where a prefill chunk of positions [start, end) may end: `end`, or the first position of a
    bidirectional image it would end inside (<= start: the chunk must wait for a step with room
    for the whole image)."""
    for feature in features:
        if feature.bidirectional and feature.offset < end < feature.end:
            return feature.offset
    return end
