"""Tiny vision-language checkpoints (Llava, Qwen2-VL, Qwen2.5-VL, Gemma 3; built once per
process), their transformers references, test images, and greedy runs of image prompts through
the engine and through transformers' `generate`."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from backend_lib.llm.core.request import EngineRequest
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.engine.llm_engine import LLMEngine
from backend_lib.multimodal.images import DecodedImage, ImageLimits, decode_image
from tests.multimodal.image_helpers import encoded
from tooling.vlm_checkpoints import build_gemma3, build_llava, build_qwen2_vl


@dataclass(frozen=True)
class VisionFamily:
    build: Callable[[Path], Path]
    model_class: type
    placeholder: str
    """What the prompt holds where an image goes."""


FAMILIES = {
    "llava": VisionFamily(build_llava, transformers.LlavaForConditionalGeneration, "<image>"),
    "qwen2_vl": VisionFamily(
        functools.partial(build_qwen2_vl, version="2"),
        transformers.Qwen2VLForConditionalGeneration,
        "<|vision_start|><|image_pad|><|vision_end|>",
    ),
    "qwen2_5_vl": VisionFamily(
        functools.partial(build_qwen2_vl, version="2.5"),
        transformers.Qwen2_5_VLForConditionalGeneration,
        "<|vision_start|><|image_pad|><|vision_end|>",
    ),
    "gemma3": VisionFamily(
        build_gemma3, transformers.Gemma3ForConditionalGeneration, "<start_of_image>"
    ),
}

_BUILT: dict[str, tuple[Path, transformers.PreTrainedModel]] = {}


def vlm_checkpoint(family: str = "llava") -> tuple[Path, transformers.PreTrainedModel]:
    """(dir, transformers model) of the tiny checkpoint of `family`."""
    if family not in _BUILT:
        out = Path(tempfile.mkdtemp(prefix=f"engine-{family}-"))
        atexit.register(shutil.rmtree, out, ignore_errors=True)
        FAMILIES[family].build(out)
        model = FAMILIES[family].model_class.from_pretrained(out, dtype=torch.float32)
        _BUILT[family] = (out, model.eval())
    return _BUILT[family]


def image(seed: int, width: int = 40, height: int = 30) -> DecodedImage:
    """A decoded random PNG (its digest is that of its encoding)."""
    return decode_image(encoded(width, height, "PNG", seed=seed), ImageLimits())


def hf_image_greedy(
    prompt: str, images: list[DecodedImage], max_tokens: int, family: str = "llava"
) -> list[int]:
    """transformers' greedy tokens for `prompt` with `images` (the checkpoint's own processing:
    Llava's and Gemma 3's processors; for Qwen2-VL, whose processor class needs torchvision, what
    it does: its image processor, each <|image_pad|> repeated grid_t x grid_h x grid_w / 4
    times)."""
    model_dir, model = vlm_checkpoint(family)
    pictures = [i.image for i in images] or None
    if family in ("llava", "gemma3"):
        processor = transformers.AutoProcessor.from_pretrained(model_dir)
        inputs = dict(processor(text=prompt, images=pictures, return_tensors="pt"))
    else:
        inputs = _qwen_inputs(model_dir, model, prompt, pictures)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _qwen_inputs(model_dir: Path, model, prompt: str, pictures) -> dict:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    inputs = {}
    if pictures:
        image_processor = transformers.AutoImageProcessor.from_pretrained(model_dir, backend="pil")
        inputs = dict(image_processor(images=pictures, return_tensors="pt"))
        counts = (inputs["image_grid_thw"].prod(-1) // 4).tolist()
        head, *rest = prompt.split("<|image_pad|>")
        prompt = head + "".join(
            "<|image_pad|>" * n + text for n, text in zip(counts, rest, strict=True)
        )
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    inputs["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    return {**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids)}


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
