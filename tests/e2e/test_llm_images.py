"""Images end to end: a vision-language llm (`vlm`, the tiny Llava of tooling/vlm_checkpoints.py)
served by a real tritonserver beside the default text models, reached through the OpenAI
frontend. The openai SDK sends a base64 PNG in chat (streamed and not) and the anthropic SDK an
image block; each answer is transformers' greedy text for the same rendered prompt and image.
Responses `input_image` parts too. Bad images and URLs are a 400 for their request alone, and 64
requests at the pixel limit in flight at once stay within bounded memory."""

from __future__ import annotations

import base64
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import numpy as np
import openai
import pytest
import torch
import transformers
from PIL import Image

from tests.multimodal.image_helpers import encoded, png_bomb
from tests.openai.frontend_helpers import start_frontend, stop_frontend
from tooling.repository import DEFAULT_MODELS, REPO_ROOT, ModelSpec, write_model
from tooling.vlm_checkpoints import build_llava

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
QUESTION = "What is in this picture?"
PIXEL_LIMIT = 1024 * 1024
"""The vlm's max_image_pixels."""


def _repository(root: Path) -> Path:
    """The default embedding and llm models, and `vlm`."""
    repository = root / "repo"
    for spec in DEFAULT_MODELS:
        if spec.kind == "embedding":
            write_model(spec, repository)
        elif spec.kind == "llm":
            parameters = {
                **spec.parameters,
                "model": str(REPO_ROOT / "models" / "shakespeare-llama"),
                "cpu_kv_cache_gb": "0.05",
                "kv_offloading_backend": "none",
                "kv_offloading_size": "0",
            }
            write_model(ModelSpec("llm", "llm", parameters, max_batch_size=0), repository)
    vlm = {
        "model": str(build_llava(root / "llava")),
        "dtype": "float32",
        "max_model_len": "256",
        "cpu_kv_cache_gb": "0.05",
        "limit_mm_per_prompt": '{"image": 2}',
        "max_image_pixels": str(PIXEL_LIMIT),
        "max_num_seqs": "4",  # the 64 requests of the memory test wait in the queue
    }
    write_model(ModelSpec("vlm", "llm", vlm, max_batch_size=0), repository)
    return repository


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.server_helpers import start_server, stop_server

    root = tmp_path_factory.mktemp("images")
    media = root / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(encoded(40, 30, seed=9))
    (root / "secret.png").write_bytes(encoded(40, 30, seed=10))
    server = start_server(_repository(root))
    try:
        front = start_frontend(
            server.grpc_url, root / "repo", "--allowed-local-media-path", str(media)
        )
        try:
            yield root, front
        finally:
            stop_frontend(front)
    finally:
        stop_server(server)


def _reference(root: Path, parts: list[dict], picture: bytes) -> str:
    """transformers' greedy answer: the processor's chat template over `parts` (transformers'
    form), its image processing, `generate`."""
    model_dir = root / "llava"
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    )
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    image = Image.open(io.BytesIO(picture)).convert("RGB")
    inputs = processor(text=prompt, images=[image], return_tensors="pt")
    with torch.inference_mode():
        out = model.eval().generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return processor.tokenizer.decode(
        out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True
    )


def _data_url(picture: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(picture).decode()


def _chat(front, url: str, **kwargs):
    client = openai.OpenAI(base_url=front.base_url, api_key="unused")
    return client.chat.completions.create(
        model=kwargs.pop("model", "vlm"),
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": QUESTION},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
        max_tokens=MAX_TOKENS,
        temperature=0,
        **kwargs,
    )


def test_openai_chat_with_a_base64_png(served):
    root, front = served
    picture = encoded(40, 30, seed=3)
    expected = _reference(root, [{"type": "text", "text": QUESTION}, {"type": "image"}], picture)
    answer = _chat(front, _data_url(picture))
    assert answer.choices[0].message.content == expected
    streamed = _chat(front, _data_url(picture), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected
    local = _chat(front, f"file://{root}/media/cat.png")
    expected_local = _reference(
        root,
        [{"type": "text", "text": QUESTION}, {"type": "image"}],
        (root / "media/cat.png").read_bytes(),
    )
    assert local.choices[0].message.content == expected_local


def test_anthropic_image_block(served):
    root, front = served
    picture = encoded(40, 30, seed=4)
    client = anthropic.Anthropic(base_url=front.url, api_key="unused")
    message = client.messages.create(
        model="vlm",
        max_tokens=MAX_TOKENS,
        extra_body={"temperature": 0},  # this SDK has no sampling arguments
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {
                            "type": "base64",
                            "media_type": "image/png",
                            "data": base64.b64encode(picture).decode(),
                        },
                    },
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
    )
    expected = _reference(root, [{"type": "image"}, {"type": "text", "text": QUESTION}], picture)
    assert message.content[0].text == expected


@pytest.mark.parametrize(
    "url, message",
    [
        ("data:image/png;base64," + base64.b64encode(encoded(40, 30)[:90]).decode(), "truncated"),
        (_data_url(png_bomb()), "decompression bomb"),
        (_data_url(encoded(8, 8, "GIF")), "not a PNG, JPEG or WebP"),
        ("data:image/png,not-base64", "must be base64"),
        ("https://example.com/cat.png", "remote image URLs are not allowed"),
        ("file://{root}/secret.png", "must lie under the allowed directory"),
        ("file://{root}/media/../secret.png", "must lie under the allowed directory"),
    ],
    ids=["truncated", "bomb", "gif", "not-base64", "remote", "outside", "dotdot"],
)
def test_a_bad_image_is_a_400_for_its_request_alone(served, url, message):
    root, front = served
    with pytest.raises(openai.BadRequestError, match=message):
        _chat(front, url.format(root=root))
    assert _chat(front, _data_url(encoded(40, 30, seed=5))).choices[0].finish_reason


def test_limits_and_text_models(served):
    root, front = served
    client = openai.OpenAI(base_url=front.base_url, api_key="unused")
    three = [
        {"type": "image_url", "image_url": {"url": _data_url(encoded(8, 8, seed=s))}}
        for s in range(3)
    ]
    with pytest.raises(openai.BadRequestError, match="at most 2 per prompt"):
        client.chat.completions.create(
            model="vlm", messages=[{"role": "user", "content": three}], max_tokens=2
        )
    with pytest.raises(openai.BadRequestError, match="takes no images"):
        _chat(front, _data_url(encoded(8, 8)), model="llm")


def test_responses_input_image(served):
    root, front = served
    picture = encoded(40, 30, seed=6)
    client = openai.OpenAI(base_url=front.base_url, api_key="unused")
    response = client.responses.create(
        model="vlm",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": QUESTION},
                    {"type": "input_image", "image_url": _data_url(picture), "detail": "auto"},
                ],
            }
        ],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    expected = _reference(root, [{"type": "text", "text": QUESTION}, {"type": "image"}], picture)
    assert response.output_text == expected


def _stub_rss(model_dir: Path) -> int:
    """Resident bytes of the Python-backend stub serving the model in `model_dir`."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            if "triton_python_backend_stub" in cmdline and str(model_dir) in cmdline:
                status = (proc / "status").read_text()
                return int(status.split("VmRSS:")[1].split()[0]) * 1024
        except (OSError, IndexError):
            continue
    raise AssertionError(f"no stub process serves {model_dir}")


def _smooth_png(seed: int) -> bytes:
    """A PNG at the pixel limit (1024 x 1024, 3 MiB decoded) of smooth gradients: a few KiB."""
    ramp = np.add.outer(np.arange(1024), np.arange(1024)) // 8
    pixels = np.stack([ramp + seed, ramp * 2, ramp + 7 * seed], axis=-1) % 256
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()


def test_64_concurrent_requests_at_the_pixel_limit_stay_within_memory(served):
    # Held decoded at once, 64 pictures at the limit would take 192 MiB. The vlm's stub decodes
    # each into its processed 28 x 28 tensor as its request arrives, so while all 64 are in
    # flight (4 running, 48 tokens each, the rest queued) its resident memory grows by far less,
    # and the server keeps answering.
    root, front = served
    stub = root / "repo" / "vlm"
    client = openai.OpenAI(base_url=front.base_url, api_key="unused", max_retries=0)
    urls = [_data_url(_smooth_png(seed)) for seed in range(64)]
    baseline = _stub_rss(stub)
    peak, done = [baseline], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _stub_rss(stub))
            time.sleep(0.005)

    def ask(url: str):
        content = [
            {"type": "text", "text": QUESTION},
            {"type": "image_url", "image_url": {"url": url}},
        ]
        return client.chat.completions.create(
            model="vlm", messages=[{"role": "user", "content": content}], max_tokens=48
        )

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(64) as pool:
            answers = list(pool.map(ask, urls))
    finally:
        done.set()
        sampler.join()
    # Every request is answered (a random model may end one at once with EOS: empty text).
    assert len(answers) == 64
    assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers)
    assert peak[0] - baseline < 64 * 2**20, f"grew {(peak[0] - baseline) / 2**20:.0f} MiB"
    picture = encoded(40, 30, seed=3)
    expected = _reference(root, [{"type": "text", "text": QUESTION}, {"type": "image"}], picture)
    assert _chat(front, _data_url(picture)).choices[0].message.content == expected
