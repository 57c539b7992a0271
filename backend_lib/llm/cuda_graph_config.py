"""The CUDA-graph setting of `LLMConfig` resolved: `cudagraph_capture_sizes` as the batch-size
buckets captured (execution/decode_graphs.py)."""

from __future__ import annotations

from backend_lib.config import ConfigError, require

FIELD = "cudagraph_capture_sizes"


def default_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's default CUDA-graph batch sizes (1, 2, 4, multiples of 8 to 256, of 16 to 512), up
    to the first that holds `max_num_seqs` decodes."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    covering = next((i for i, size in enumerate(sizes) if size >= max_num_seqs), len(sizes) - 1)
    return tuple(sizes[: covering + 1])


def capture_sizes(text: str, max_num_seqs: int) -> tuple[int, ...]:
    """`text` (comma-separated sizes; "": the defaults) as ascending distinct sizes; ConfigError
    naming the field when it is not that."""
    text = text.strip()
    if not text:
        return default_capture_sizes(max_num_seqs)
    try:
        sizes = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise ConfigError(FIELD, text, "expected comma-separated integers") from None
    require(sizes[0] >= 1, FIELD, text, "sizes must be >= 1")
    return tuple(sizes)
