"""The quality gates of issue 27 on pre-quantized checkpoints of the default model: held-out
perplexity (test_quantization_quality's harness and passages) of the Shakespeare model quantized by
compressed-tensors, loaded as stored, against float32.

Measured when the test was written (AMD EPYC, AVX-512): float32 32.05; W8A16 channel +0.02%,
W8A8 dynamic +0.28%, FP8 dynamic +0.12%, W4A16 group 128 (down_proj group 64) +1.15%, W4A16
group 64 asymmetric +0.46%.
"""

from __future__ import annotations

import pytest

from tests.llm.execution.perplexity_helpers import engine_perplexity, passages, runner
from tests.llm.quantized_checkpoint_helpers import quantized_shakespeare

pytestmark = pytest.mark.usefixtures("single_torch_thread")

GATES = {
    "W8A16_CHANNEL": 0.01,
    "W8A8_DYNAMIC": 0.01,
    "FP8_DYNAMIC": 0.01,
    "W4A16_G128": 0.05,
    "W4A16_G64_ASYM": 0.05,
}
"""Preset -> largest relative perplexity increase over float32."""


@pytest.fixture(scope="module")
def float32_perplexity() -> float:
    return engine_perplexity(runner(), passages())


@pytest.mark.parametrize("preset", GATES)
def test_perplexity_of_the_stored_checkpoint_is_within_its_gate(float32_perplexity, preset):
    ppl = engine_perplexity(runner(quantized_shakespeare(preset)), passages())
    print(f"{preset}: perplexity {ppl:.3f} vs float32 {float32_perplexity:.3f}")
    assert ppl <= float32_perplexity * (1 + GATES[preset]), (ppl, float32_perplexity)
    # Much better is as suspicious as much worse, and the very float perplexity means the float
    # weights were loaded instead.
    assert ppl >= float32_perplexity * (1 - 0.01), (ppl, float32_perplexity)
    assert ppl != pytest.approx(float32_perplexity, rel=1e-5)
