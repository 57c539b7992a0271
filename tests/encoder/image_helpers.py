"""Images and the transformers reference of the image-text (CLIP, SigLIP) tests: encoded pictures
of several formats, sizes and colour modes, broken ones, and `Reference`, a checkpoint's own
processor and model computing what the embedding model must answer."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import AutoModel, AutoProcessor

TEXTS = [
    "a photo of a cat",
    "The red rose smells SWEET, at night!",
    "x",
    "a storm at sea " * 30,  # over both text towers' positions: cut
]


def encode(image: Image.Image, image_format: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format=image_format)
    return out.getvalue()


def picture(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    """A smooth random picture (colour blobs over a gradient: each seed looks different)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    phases = rng.uniform(0, 2 * np.pi, size=(3, 2))
    channels = [
        127.5 + 127.5 * np.sin(6 * x * rng.uniform(0.5, 2) + p) * np.cos(5 * y + q)
        for p, q in phases
    ]
    rgb = Image.fromarray(np.stack(channels, axis=-1).astype(np.uint8), "RGB")
    return rgb.convert(mode)


def pictures() -> list[bytes]:
    """Encoded images of each accepted format, several sizes and aspect ratios, RGB, RGBA,
    greyscale and palette modes."""
    return [
        encode(picture(48, 40, 1), "PNG"),
        encode(picture(30, 50, 2, "RGBA"), "PNG"),
        encode(picture(64, 64, 3, "L"), "JPEG"),
        encode(picture(90, 20, 4), "WEBP"),
        encode(picture(33, 33, 5, "P"), "PNG"),
        encode(picture(200, 120, 6), "JPEG"),
    ]


def truncated_png() -> bytes:
    whole = encode(picture(64, 64, 7), "PNG")
    return whole[: len(whole) // 2]


def gif() -> bytes:
    return encode(picture(16, 16, 8, "P"), "GIF")


def bmp() -> bytes:
    return encode(picture(16, 16, 9), "BMP")


class Reference:
    """A checkpoint's own transformers processor (PIL backend) and model, float32: the texts'
    `get_text_features` and the images' `get_image_features`, tokenized and preprocessed as the
    model cards say (SigLIP: `padding="max_length"`, as it was trained)."""

    def __init__(self, model_dir: Path):
        self.processor = AutoProcessor.from_pretrained(
            model_dir, backend="pil", local_files_only=True
        )
        self.model = AutoModel.from_pretrained(model_dir, local_files_only=True).eval()
        siglip = self.model.config.model_type == "siglip"
        self.padding = "max_length" if siglip else True

    def text_ids(self, texts: list[str]) -> dict[str, torch.Tensor]:
        return self.processor(
            text=texts, padding=self.padding, truncation=True, return_tensors="pt"
        )

    def text_token_counts(self, texts: list[str]) -> list[int]:
        """Tokens of each text as the model reads them (padding included where it pads all)."""
        encoded = self.text_ids(texts)
        mask = encoded.get("attention_mask")
        if mask is None:  # SigLIP: no mask, every row is read whole
            return [encoded["input_ids"].shape[1]] * len(texts)
        return mask.sum(dim=1).tolist()

    @torch.inference_mode()
    def texts(self, texts: list[str], normalize: bool = True) -> np.ndarray:
        vectors = self.model.get_text_features(**self.text_ids(texts)).pooler_output
        return (F.normalize(vectors, dim=1) if normalize else vectors).numpy()

    def pixels(self, images: list[bytes]) -> torch.Tensor:
        decoded = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
        return self.processor(images=decoded, return_tensors="pt")["pixel_values"]

    @torch.inference_mode()
    def images(self, images: list[bytes], normalize: bool = True) -> np.ndarray:
        vectors = self.model.get_image_features(pixel_values=self.pixels(images)).pooler_output
        return (F.normalize(vectors, dim=1) if normalize else vectors).numpy()

    @torch.inference_mode()
    def image_token_count(self) -> int:
        """The vision tower's sequence length, as its forward computes it."""
        pixels = self.pixels([encode(picture(8, 8, 0), "PNG")])
        return self.model.vision_model(pixel_values=pixels).last_hidden_state.shape[1]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two [N, D] arrays."""
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
