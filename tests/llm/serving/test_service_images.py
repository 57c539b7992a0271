"""The llm's Triton `image` input: images sent as Triton's vLLM backend sends them (base64 text,
one per element) or as raw bytes give transformers' greedy text for the same prompt and images;
a bad image fails its request alone with a clear error."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import transformers

from backend_lib.errors import InputError
from tests.llm.engine_helpers import assert_pool_released
from tests.llm.service_helpers import service_from_context
from tests.llm.vlm_helpers import hf_image_greedy, image, vlm_checkpoint
from tests.multimodal.image_helpers import encoded, png_bomb

pytestmark = pytest.mark.usefixtures("single_torch_thread")

PROMPT = "USER: <image> and <image>\nASSISTANT:"


def _inputs(images: list[bytes], prompt: str = PROMPT) -> dict[str, np.ndarray]:
    params = json.dumps({"temperature": 0, "max_tokens": 8})
    return {
        "text_input": np.array([prompt.encode()], dtype=object),
        "stream": np.array([False]),
        "sampling_parameters": np.array([params.encode()], dtype=object),
        "image": np.array(images, dtype=object),
    }


def _text(service, job) -> str:
    return b"".join(b"".join(r["text_output"]) for r, _ in service.responses(job)).decode()


@pytest.fixture(scope="module")
def service():
    service = service_from_context(vlm_checkpoint()[0])
    yield service
    service.shutdown()


def test_base64_and_raw_images_give_generates_text(service):
    files = [encoded(40, 30, seed=s) for s in (3, 4)]
    tokenizer = transformers.AutoTokenizer.from_pretrained(vlm_checkpoint()[0])
    ids = hf_image_greedy(PROMPT, [image(3), image(4)], 8)
    expected = PROMPT + tokenizer.decode(ids, skip_special_tokens=True)
    vllm_backend_style = [base64.b64encode(f) for f in files]
    for images in (vllm_backend_style, files):
        assert _text(service, service.submit(_inputs(images))) == expected
    assert_pool_released(service.engine)


@pytest.mark.parametrize(
    "images, message",
    [
        ([encoded(40, 30)[:80], encoded(8, 8)], "truncated or corrupt"),
        ([png_bomb(), encoded(8, 8)], "decompression bomb"),
        ([encoded(8, 8, "GIF"), encoded(8, 8)], "not a PNG, JPEG or WebP"),
        ([encoded(8, 8)] * 9, r"at most 8 are allowed \(limit_mm_per_prompt\)"),
        ([b"!!not base64 nor image"], "not a PNG, JPEG or WebP"),
    ],
    ids=["truncated", "bomb", "gif", "too-many", "garbage"],
)
def test_a_bad_image_fails_its_request_alone(service, images, message):
    with pytest.raises(InputError, match=message):
        service.submit(_inputs(images))
    job = service.submit(_inputs([encoded(40, 30, seed=5), encoded(40, 30, seed=6)]))
    assert _text(service, job).startswith(PROMPT)
    assert_pool_released(service.engine)
