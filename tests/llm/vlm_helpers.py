"""A tiny Llava checkpoint (built once per process), its transformers reference, test images,
and greedy runs of image prompts through the engine and through transformers' `generate`."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import torch
import transformers

from backend_lib.llm.core.request import EngineRequest
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.engine.llm_engine import LLMEngine
from backend_lib.multimodal.images import DecodedImage, ImageLimits, decode_image
from tests.multimodal.image_helpers import encoded
from tooling.vlm_checkpoints import build_llava

_BUILT: dict[str, tuple[Path, transformers.PreTrainedModel, transformers.ProcessorMixin]] = {}

IMAGE_TOKENS = 16
"""Placeholder tokens per image of the tiny Llava: (28 / 7)^2."""


def llava_checkpoint() -> tuple[Path, transformers.PreTrainedModel, transformers.ProcessorMixin]:
    """(dir, transformers model, processor) of the tiny Llava."""
    if "llava" not in _BUILT:
        out = Path(tempfile.mkdtemp(prefix="engine-llava-"))
        atexit.register(shutil.rmtree, out, ignore_errors=True)
        build_llava(out)
        model = transformers.LlavaForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
        _BUILT["llava"] = (out, model.eval(), transformers.AutoProcessor.from_pretrained(out))
    return _BUILT["llava"]


def image(seed: int, width: int = 40, height: int = 30) -> DecodedImage:
    """A decoded random PNG (its digest is that of its encoding)."""
    return decode_image(encoded(width, height, "PNG", seed=seed), ImageLimits())


def hf_image_greedy(prompt: str, images: list[DecodedImage], max_tokens: int) -> list[int]:
    """transformers' greedy tokens for `prompt` with `images`, its processor's inputs."""
    _, model, processor = llava_checkpoint()
    inputs = processor(text=prompt, images=[i.image for i in images] or None, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def image_request(
    request_id: str, prompt: str, images: list[DecodedImage], max_tokens: int
) -> EngineRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)  # stops at EOS, as generate
    return EngineRequest(request_id, prompt, params, images=tuple(images))


def run_all(engine: LLMEngine, requests: list[EngineRequest]) -> dict:
    """Add every request, step until all finished; final outputs by request id."""
    for request in requests:
        engine.add(request)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    return outputs
