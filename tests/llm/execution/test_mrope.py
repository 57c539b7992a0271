"""Qwen2-VL's M-RoPE (execution/models/qwen2_vl.py) against transformers: the three positions of
every token of a prompt with images, and of the tokens generated after it, equal `get_rope_index`;
the step's rotary table, rows gathered per frequency section, equals transformers' cos and sin."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from backend_lib.llm.core.multimodal import MultiModalFeature
from backend_lib.llm.execution.models.qwen2_vl import mrope_positions, mrope_table
from kernels.rotary import rope_cos_sin_cache

IMAGE = 9


def _prompt(grids: list[tuple[int, int, int]], texts: list[int]) -> tuple[list[int], list]:
    """Token ids: texts[0] text tokens, image 0's placeholders, texts[1] ..., and the features."""
    ids, features = [5] * texts[0], []
    for i, (grid, text) in enumerate(zip(grids, texts[1:], strict=True)):
        length = grid[0] * grid[1] * grid[2] // 4
        data = {"image_grid_thw": torch.tensor([grid])}
        features.append(MultiModalFeature(bytes([i]) * 32, len(ids), length, data))
        ids += [IMAGE] * length + [5] * text
    return ids, features


@pytest.mark.parametrize(
    "grids, texts",
    [
        ([(1, 4, 6)], [3, 5]),
        ([(1, 6, 4), (1, 8, 8)], [0, 2, 4]),
        ([(1, 4, 4), (1, 2, 10)], [7, 1, 1]),  # images always have text between (vision_end)
    ],
)
def test_positions_equal_get_rope_index(grids, texts):
    config = transformers.Qwen2VLConfig(
        vision_config={"spatial_merge_size": 2}, text_config={"vocab_size": 16}
    )
    config.image_token_id = IMAGE
    ids, features = _prompt(grids, texts)
    input_ids = torch.tensor([ids])
    reference, delta = transformers.Qwen2VLModel.get_rope_index(
        _ConfigOnly(config), input_ids, (input_ids == IMAGE).int(), torch.tensor(grids)
    )
    ours = mrope_positions(features, 2, 0, len(ids))
    np.testing.assert_array_equal(ours, reference[:, 0].numpy())
    # Generated tokens: all three at index + delta; and any chunk is a slice of the whole.
    after = mrope_positions(features, 2, len(ids), len(ids) + 5)
    np.testing.assert_array_equal(
        after, np.tile(np.arange(len(ids), len(ids) + 5), (3, 1)) + int(delta)
    )
    np.testing.assert_array_equal(mrope_positions(features, 2, 3, 11), ours[:, 3:11])


class _ConfigOnly:
    """What `get_rope_index` reads of its model: the config, and the vision position helper."""

    def __init__(self, config):
        self.config = config

    def get_vision_position_ids(self, *args, **kwargs):
        return transformers.Qwen2VLModel.get_vision_position_ids(self, *args, **kwargs)


def test_the_step_table_equals_transformers_cos_sin():
    config = transformers.Qwen2VLTextConfig(
        hidden_size=64,
        num_attention_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    rotary = transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VLRotaryEmbedding(config)
    positions = torch.tensor([[0, 3, 3, 3, 9], [0, 3, 4, 5, 9], [0, 3, 5, 4, 9]])
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    cache = rope_cos_sin_cache(16, 64, 10000.0, None, torch.float32, "cpu")
    table = mrope_table(cache, positions, (2, 3, 3))
    torch.testing.assert_close(table[:, :8], cos[0, :, :8])
    torch.testing.assert_close(table[:, 8:], sin[0, :, :8])
    with pytest.raises(ValueError, match="does not cover the 8 frequencies"):
        mrope_table(cache, positions, (2, 3, 2))
