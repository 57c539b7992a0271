"""llama.cpp's quantized blocks decoded into the WNA16 layer's terms (backend_lib/gguf_quants.py):
for every type, random raw blocks (any scale, minimum and value bits) dequantize bit for bit as
`gguf.quants.dequantize`, and bringing fused layers to one layout changes no value; the converted
checkpoint's `quant_method: gguf` config is checked, naming the bad layer."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from backend_lib.gguf_quants import BLOCK_BYTES, decode, harmonize
from backend_lib.llm.execution.checkpoint_quantization import (
    CheckpointFormatError,
    read_checkpoint_quantization,
)
from kernels.wna16_linear import dequantize_wna16, pack_wna16


def _raw(kind: str, rows: int, seed: int) -> np.ndarray:
    """Random blocks of `kind` for a [rows, 512] weight; float16 fields drawn finite."""
    rng = np.random.default_rng(seed)
    blocks_per_row = 512 // gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, kind)][0]
    data = rng.integers(0, 256, (rows * blocks_per_row, BLOCK_BYTES[kind]), dtype=np.uint8)
    halves = rng.normal(0, 0.05, (data.shape[0], 2)).astype(np.float16).view(np.uint8)
    if kind == "Q6_K":
        data[:, -2:] = halves[:, :2]
    else:  # d (and m / dmin) lead the block
        data[:, :4] = halves
    return data.reshape(rows, -1)


@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_random_blocks_dequantize_bit_for_bit_as_gguf(kind):
    data = _raw(kind, 6, seed=len(kind) + ord(kind[1]))
    want = gguf.quants.dequantize(data, getattr(gguf.GGMLQuantizationType, kind))
    weight = decode(kind, data)
    assert weight.values.shape == want.shape and weight.values.max() < 1 << (
        6 if kind == "Q6_K" else 5 if kind.startswith("Q5") else 8 if kind == "Q8_0" else 4
    )
    assert np.array_equal(weight.dequantized().view(np.uint32), want.view(np.uint32))
    # The engine's own twin on the packed layout gives the same bits.
    mins = {} if weight.mins is None else {"mins": torch.from_numpy(weight.mins)}
    ours = dequantize_wna16(
        pack_wna16(torch.from_numpy(weight.values), weight.bits),
        torch.from_numpy(weight.scales),
        torch.from_numpy(weight.zeros),
        weight.group_size,
        weight.bits,
        **mins,
    )
    assert torch.equal(ours, torch.from_numpy(want))


def test_one_layout_for_fused_layers_changes_no_value():
    parts = [decode(kind, _raw(kind, 4, seed=i)) for i, kind in enumerate(("Q4_K", "Q6_K", "Q8_0"))]
    joined = harmonize(parts)
    assert {(w.bits, w.group_size, w.mins is not None) for w in joined} == {(8, 16, True)}
    for before, after in zip(parts, joined, strict=True):
        assert np.array_equal(
            before.dequantized().view(np.uint32), after.dequantized().view(np.uint32)
        )
    same = harmonize(parts[:1] * 2)
    assert same[0] is parts[0]


@pytest.mark.parametrize(
    "layers, message",
    [
        ({}, "has no `layers`"),
        ({"model.layers.0.mlp.up_proj": {"bits": 4}}, r"layers\['model.layers.0.mlp.up_proj'\]"),
        ({"m": {"bits": 6, "group_size": 32, "float_mins": False}}, "bits 6"),
    ],
)
def test_a_bad_gguf_quantization_config_names_the_layer(layers, message):
    config = {"quantization_config": {"quant_method": "gguf", "layers": layers}}
    with pytest.raises(CheckpointFormatError, match=message):
        read_checkpoint_quantization(config)
