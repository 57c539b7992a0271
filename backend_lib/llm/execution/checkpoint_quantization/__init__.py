"""Pre-quantized checkpoints: which formats load, and how their layers are staged and served.

- scheme.py: `WeightScheme` (one layer's stored quantization) and the staging-tensor layouts.
- format.py: `QuantizedFormat`, what every format shares (regrouping the tensor stream per layer).
- compressed_tensors.py: llm-compressor's compressed-tensors format.
- gptq.py, awq.py (their shared part: packed_int.py): GPTQ and AWQ (GEMM) checkpoints.
- gguf_blocks.py: GGUF's quantized tensors, as a converted GGUF checkpoint stores them.
- layers.py: the staging layers the loader fills, and the layers that compute after loading.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backend_lib.llm.execution.checkpoint_quantization.awq import AWQFormat
from backend_lib.llm.execution.checkpoint_quantization.compressed_tensors import (
    CompressedTensorsFormat,
)
from backend_lib.llm.execution.checkpoint_quantization.format import QuantizedFormat
from backend_lib.llm.execution.checkpoint_quantization.gguf_blocks import GGUFFormat
from backend_lib.llm.execution.checkpoint_quantization.gptq import GPTQFormat
from backend_lib.llm.execution.checkpoint_quantization.scheme import CheckpointFormatError

CheckpointQuantization = QuantizedFormat
"""A parsed checkpoint quantization format (`method`, `describe()`, `scheme_for(module)`,
`stored_layers(tensor_names)`, `translate(tensors, layers)`)."""

_FORMATS = {f.method: f for f in (CompressedTensorsFormat, GPTQFormat, AWQFormat, GGUFFormat)}
SUPPORTED_METHODS = tuple(_FORMATS)


def read_checkpoint_quantization(hf_config: Mapping[str, Any]) -> CheckpointQuantization | None:
    """The checkpoint's quantization from config.json's `quantization_config`; None when it has
    none. CheckpointFormatError for a method or scheme this engine cannot serve."""
    config = hf_config.get("quantization_config")
    if not config:
        return None
    method = config.get("quant_method")
    if method not in _FORMATS:
        raise CheckpointFormatError(
            f"quantization_config.quant_method {method!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_METHODS)}"
        )
    return _FORMATS[method](config)


__all__ = [
    "CheckpointFormatError",
    "CheckpointQuantization",
    "SUPPORTED_METHODS",
    "read_checkpoint_quantization",
]
