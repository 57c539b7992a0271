"""Image and text embeddings of CLIP and SigLIP checkpoints (backend_lib/encoder/image_text.py)
through the embedding model's service, against each checkpoint's own transformers processor and
model (`get_text_features`, `get_image_features`): texts, token ids and images of every accepted
format and colour mode; texts and images of one scheduler micro-batch computed apart; per-row
normalisation; bad images failing their own request only; one input kind per request; the
checkpoint settings checked at load; image items counted in `encoder_items_total`."""

from __future__ import annotations

import base64
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest

from backend_lib.config import ConfigError
from backend_lib.contract import (
    DIMENSIONS,
    EMBEDDING,
    IMAGE,
    INPUT_IDS,
    NORMALIZE,
    NUM_INPUT_TOKENS,
    PROMPT_NAME,
    TEXT_INPUT,
)
from backend_lib.encoder.config import EmbeddingConfig
from backend_lib.encoder.image_text import ImageTextEmbedder
from backend_lib.encoder.service import EmbeddingService, ImageTextEmbeddingService
from backend_lib.errors import InputError
from backend_lib.metrics import PrometheusMetrics, parse_prometheus_text
from backend_lib.model_context import ModelContext
from tests.encoder.image_helpers import (
    TEXTS,
    Reference,
    bmp,
    cosine,
    encode,
    gif,
    picture,
    pictures,
    truncated_png,
)

CPU = torch.device("cpu")
LABELS = {"model": "embedding", "version": "1"}


def strings(*values: str | bytes) -> np.ndarray:
    return np.array([[v.encode() if isinstance(v, str) else v] for v in values], dtype=object)


def load(model_dir: Path, sink=None, **parameters: str) -> EmbeddingService:
    """The embedding model's service as model.py loads it, on `model_dir`."""
    values = {"model": str(model_dir), "dtype": "float32", **parameters}
    context = ModelContext("embedding", "1", Path("."), CPU, values, {})
    return EmbeddingService.from_context(context, sink)


@dataclass
class Served:
    model_dir: Path
    service: ImageTextEmbeddingService
    reference: Reference


@pytest.fixture(scope="module", params=["clip", "siglip"])
def served(request) -> Served:
    """Each checkpoint's service (micro-batches of at most 128 padded tokens: several per call)
    and its transformers reference."""
    model_dir = request.getfixturevalue(f"{request.param}_dir")
    service = load(model_dir, max_batch_tokens="128")
    assert isinstance(service, ImageTextEmbeddingService)
    return Served(model_dir, service, Reference(model_dir))


def test_texts_token_ids_and_images_equal_transformers(served):
    service, reference = served.service, served.reference
    images = pictures()
    ids = reference.processor.tokenizer(TEXTS[0])["input_ids"]  # unpadded: the model pads
    as_base64 = base64.b64encode(images[0])  # as Triton's vLLM backend clients send images
    texts, embedded, from_ids, from_base64 = service.execute(
        [
            {TEXT_INPUT: strings(*TEXTS)},
            {IMAGE: strings(*images)},
            {INPUT_IDS: np.array([ids])},
            {IMAGE: strings(as_base64)},
        ]
    )
    assert cosine(texts[EMBEDDING], reference.texts(TEXTS)).min() >= 0.99999
    assert cosine(embedded[EMBEDDING], reference.images(images)).min() >= 0.99999
    for vectors in (texts[EMBEDDING], embedded[EMBEDDING]):
        assert vectors.dtype == np.float32
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)  # default
        assert np.ptp(vectors, axis=0).max() > 1e-3  # different inputs, different vectors
    np.testing.assert_allclose(from_ids[EMBEDDING], texts[EMBEDDING][:1], atol=1e-6)
    np.testing.assert_allclose(from_base64[EMBEDDING], embedded[EMBEDDING][:1], atol=1e-6)
    assert texts[NUM_INPUT_TOKENS][:, 0].tolist() == reference.text_token_counts(TEXTS)
    image_tokens = embedded[NUM_INPUT_TOKENS][:, 0].tolist()
    assert image_tokens == [reference.image_token_count()] * len(images)


def test_one_micro_batch_of_texts_and_images_runs_each_tower_apart(served, monkeypatch):
    """The scheduler hands `_compute` a mixed micro-batch; texts and images each get their own
    forward, and `normalize` still applies per row; the image items are counted as items."""
    reference = served.reference
    sink = PrometheusMetrics(LABELS, extra_labels={"encoder_failures_total": ["reason"]})
    service = load(served.model_dir, sink)  # the default budget: one micro-batch holds all
    mixed, forwards = [], []
    monkeypatch.setattr(service, "_compute", recording(service._compute, "_compute", mixed))
    for name in ("embed", "embed_images"):
        method = getattr(service.embedder, name)
        monkeypatch.setattr(service.embedder, name, recording(method, name, forwards))
    images = pictures()[:2]
    texts = ["a photo of a cat", "a dog"]
    unit_first = np.array([[True], [False]])
    by_text, raw_images, unit_images = service.execute(
        [
            {TEXT_INPUT: strings(*texts), NORMALIZE: unit_first},
            {IMAGE: strings(*images), NORMALIZE: np.array([[False]])},
            {IMAGE: strings(images[0])},
        ]
    )
    assert mixed == [("_compute", 5)]  # one micro-batch: 2 texts, 3 images
    assert sorted(forwards) == [("embed", 2), ("embed_images", 3)]
    np.testing.assert_allclose(by_text[EMBEDDING][0], reference.texts(texts)[0], atol=1e-5)
    expected = reference.texts(texts, normalize=False)[1]
    np.testing.assert_allclose(by_text[EMBEDDING][1], expected, rtol=1e-4, atol=1e-5)
    expected = reference.images(images, normalize=False)
    np.testing.assert_allclose(raw_images[EMBEDDING], expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(unit_images[EMBEDDING], reference.images(images[:1]), atol=1e-5)
    samples = parse_prometheus_text(generate_latest(sink.registry).decode())
    assert samples[("encoder_items_total", frozenset(LABELS.items()))] == 5


def recording(method, name: str, calls: list):
    """`method`, noting (name, number of items) of each call in `calls`."""

    def spy(values, *args, **kwargs):
        calls.append((name, len(values)))
        return method(values, *args, **kwargs)

    return spy


def test_bad_images_fail_their_request_alone(clip_dir):
    """Beside good requests in the same call, each bad image fails its own request with what is
    wrong; a request with one bad image among good ones fails naming its row."""
    service = load(clip_dir, max_image_pixels=str(64 * 64))
    reference = Reference(clip_dir)
    good = pictures()[:2]
    large = encode(picture(100, 100, 1), "PNG")
    cases = [
        ("truncated or corrupt", truncated_png()),
        ("(the supported formats)", gif()),
        ("(the supported formats)", bmp()),
        ("100x100 = 10000 pixels; the limit is 4096 (max_image_pixels)", large),
        ("aspect ratio is too extreme", encode(picture(2, 60, 2), "PNG")),
        ("empty (0 bytes)", b""),
    ]
    requests = [{IMAGE: strings(*good)}]
    requests += [{IMAGE: strings(data)} for _, data in cases]
    requests += [{IMAGE: strings(good[0], truncated_png())}, {TEXT_INPUT: strings("a cat")}]
    first, *bad, mixed, text = service.execute(requests)
    assert cosine(first[EMBEDDING], reference.images(good)).min() >= 0.99999
    for (message, _), error in zip(cases, bad, strict=True):
        assert isinstance(error, InputError) and message in str(error), (message, error)
        assert str(error).startswith("input 'image'[0]: ")
    assert isinstance(mixed, InputError) and str(mixed).startswith("input 'image'[1]: ")
    assert cosine(text[EMBEDDING], reference.texts(["a cat"])).min() >= 0.99999


@pytest.mark.parametrize(
    "inputs,message",
    [
        (
            {TEXT_INPUT: strings("a"), IMAGE: strings(b"x")},
            "send exactly one of 'text_input' (texts), 'input_ids' (token ids) and 'image' "
            "(encoded images); got text_input, image",
        ),
        ({NORMALIZE: np.array([[True]])}, "got none"),
        ({IMAGE: strings(b"x"), PROMPT_NAME: strings("query")}, "'prompt_name' applies to"),
        ({IMAGE: strings(b"x"), DIMENSIONS: np.array([[7]], np.int32)}, "'dimensions' 7"),
        ({TEXT_INPUT: strings("a"), PROMPT_NAME: strings("query")}, "has no prompts"),
    ],
)
def test_a_request_sends_one_input_kind(served, inputs, message):
    (error,) = served.service.execute([inputs])
    assert isinstance(error, InputError) and message in str(error)


def test_a_text_only_model_refuses_images(minilm):
    (error,) = EmbeddingService(minilm).execute([{IMAGE: strings(encode(picture(8, 8, 0), "PNG"))}])
    assert isinstance(error, InputError)
    assert "input 'image': this is a text-only embedding model" in str(error)
    assert "CLIPModel, SiglipModel" in str(error)


def test_checkpoint_settings_are_checked_at_load(clip_dir, siglip_dir, tmp_path):
    def embedder(model_dir: Path, **settings) -> ImageTextEmbedder:
        config = EmbeddingConfig(model=str(model_dir), dtype="float32", **settings)
        return ImageTextEmbedder.from_config(config, CPU, Path("."))

    clip, siglip = embedder(clip_dir), embedder(siglip_dir)
    assert (clip.max_seq_length, siglip.max_seq_length) == (77, 64)
    assert (clip.max_batch_tokens, clip.normalize_default, clip.dimensions) == (4096, True, (16,))
    assert embedder(clip_dir, normalize=False).normalize_default is False
    assert len(siglip.tokenize(["a cat"])[0]) == 64  # padded, as SiglipProcessor is used
    for settings, key, reason in [
        ({"mode": "sparse"}, "mode", "dense vectors only"),
        ({"max_seq_length": 100}, "max_seq_length", "hold at most 77 tokens"),
        ({"max_image_pixels": 1000}, "max_image_pixels", "at least 32x32 pixels"),
        ({"max_batch_tokens": 16}, "max_batch_tokens", "must hold one item of"),
    ]:
        with pytest.raises(ConfigError, match=reason) as raised:
            embedder(clip_dir, **settings)
        assert raised.value.key == key
    copy = Path(shutil.copytree(clip_dir, tmp_path / "no-processor"))
    (copy / "preprocessor_config.json").unlink()
    with pytest.raises(ConfigError, match="no preprocessor_config.json"):
        embedder(copy)
