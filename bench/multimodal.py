"""Images beside text: a vision-language model (a random Llava: CLIP tower, projector, Llama
decoder, built with transformers) on the engine vs transformers' `generate`, same checkpoint,
prompts and images.

16 requests, each a chat prompt with one or two images drawn from 8 distinct pictures (so images
repeat, as a screenshot or document does across an agent's turns), a fixed number of greedy
output tokens. The engine takes all 16 at once (continuous batching); transformers runs one
batched `generate` over the 16 (left padding). Before any timing, the engine's tokens must equal
transformers' unpadded `generate` for every request. The systems alternate order every repeat.
Also reported: the encoder cache's hit rate on this workload (images encoded once per distinct
picture and engine, however often they repeat).

    python -m bench.multimodal [--quick] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import io
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from bench import cli
from bench.output import progress
from bench.skeleton import Benchmark
from bench.summary import summary_line, target_of
from bench.timing import spread, time_interleaved
from tooling.vlm_checkpoints import LlavaSizes, build_llava

NAME = "multimodal"
HEADING = "Images: a vision-language model on the engine vs transformers generate"
DEFAULTS = cli.Defaults("float32", threads=1, repeats=3)
VLM_TARGET = target_of("vlm_vs_hf_generate")
CLIP_TARGET = target_of("clip_image_embedding_vs_transformers")
QUESTIONS = ("What is shown here?", "Describe the picture.", "Compare these.", "What colour?")


@dataclass(frozen=True)
class Preset:
    sizes: LlavaSizes
    requests: int
    pictures: int
    """Distinct images the requests draw from."""
    output_len: int
    clip_tower: dict[str, int] | None
    """The CLIP vision tower of the embedding half (None: the tests' tiny one)."""
    clip_images: int
    """Images embedded per run."""


VIT_S = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=6)
"""A ViT-S/32-shaped CLIP vision tower (22M parameters, 50 tokens per 224-pixel image)."""
VIT_B = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)

PRESETS = {
    "quick": Preset(LlavaSizes(), 16, 8, 8, None, 16),
    "cpu": Preset(LlavaSizes(256, 4, 224, 14, 512, 6), 16, 8, 64, VIT_S, 64),
    "cuda": Preset(LlavaSizes(512, 12, 224, 14, 1024, 12), 16, 8, 64, VIT_B, 512),
}
CLIP_BATCH = 32
"""Images per transformers call (what a user batching by hand would pick)."""


@dataclass(frozen=True)
class Request:
    prompt: str
    """Rendered with the checkpoint's chat template: one `<image>` per picture."""
    pictures: tuple[int, ...]
    """Indices into the workload's encoded images."""


def encoded_pictures(count: int, seed: int) -> list[bytes]:
    """PNG photos-to-be: random pixels of assorted sizes."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        width, height = (int(v) for v in rng.integers(48, 320, 2))
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (height, width, 3), np.uint8)).save(buffer, "PNG")
        out.append(buffer.getvalue())
    return out


def workload(preset: Preset, processor, seed: int) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for i in range(preset.requests):
        count = 1 + (i % 3 == 2)  # every third request holds two images
        pictures = tuple(rng.randrange(preset.pictures) for _ in range(count))
        parts = [{"type": "image"}] * count + [{"type": "text", "text": rng.choice(QUESTIONS)}]
        prompt = processor.apply_chat_template(
            [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
        )
        requests.append(Request(prompt, pictures))
    return requests


def run_engine(engine, requests: list[Request], images: list, output_len: int) -> list[list[int]]:
    from backend_lib.llm.core.request import EngineRequest
    from bench.llm import greedy

    for i, request in enumerate(requests):
        pictures = tuple(images[p] for p in request.pictures)
        engine.add(EngineRequest(f"r{i}", request.prompt, greedy(output_len), images=pictures))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    return [outputs[f"r{i}"].outputs[0].token_ids for i in range(len(requests))]


def hf_generate(model, processor, requests, images, output_len, batched: bool) -> list[list[int]]:
    """transformers' greedy tokens: one padded batch, or each request alone."""
    import torch

    groups = [requests] if batched else [[r] for r in requests]
    out = []
    for group in groups:
        inputs = processor(
            text=[r.prompt for r in group],
            images=[images[p].image for r in group for p in r.pictures],
            return_tensors="pt",
            padding=True,
        )
        with torch.inference_mode():
            tokens = model.generate(
                **inputs, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False
            )
        out += tokens[:, inputs["input_ids"].shape[1] :].tolist()
    return out


def clip_run(preset: Preset, scratch: Path, pictures: list[bytes], args, dtype: str) -> dict:
    """CLIP image embeddings: the embedding model's path (decode within limits, the image
    processor, micro-batched `get_image_features`; dtype auto: bfloat16 where the CPU has native
    bfloat16) vs transformers' processor and model in float32, CLIP_BATCH images a call; and
    ours in float32 too. Vectors checked (cosine >= 0.99999, float32) before timing."""
    import torch
    import transformers

    from backend_lib.encoder.config import EmbeddingConfig
    from backend_lib.encoder.image_text import ImageTextEmbedder
    from tooling.vision_checkpoints import build_clip

    tower = preset.clip_tower
    clip_dir = build_clip(scratch / "clip", args.seed, tower, *((224, 32) if tower else ()))
    images = [pictures[i % len(pictures)] for i in range(preset.clip_images)]
    processor = transformers.AutoProcessor.from_pretrained(clip_dir)
    model = transformers.CLIPModel.from_pretrained(clip_dir, dtype=torch.float32).eval()

    def ours(embedder) -> Callable[[], tuple[np.ndarray, float]]:
        def run_once() -> tuple[np.ndarray, float]:
            started = time.perf_counter()
            pixels = [embedder.preprocess_image(data) for data in images]
            vectors = embedder.embed_images(pixels, normalize=False)[0]
            return vectors, time.perf_counter() - started

        return run_once

    def hf() -> tuple[np.ndarray, float]:
        started = time.perf_counter()
        out = []
        for start in range(0, len(images), CLIP_BATCH):
            batch = [
                Image.open(io.BytesIO(d)).convert("RGB") for d in images[start : start + CLIP_BATCH]
            ]
            inputs = processor(images=batch, return_tensors="pt")
            with torch.inference_mode():
                out.append(model.get_image_features(**inputs).pooler_output.numpy())
        return np.concatenate(out), time.perf_counter() - started

    embedders = {
        name: ImageTextEmbedder.from_config(
            EmbeddingConfig(model=str(clip_dir), dtype=kind), torch.device("cpu"), scratch
        )
        for name, kind in (("ours_auto", "auto"), ("ours_float32", "float32"))
    }
    reference, _ = hf()
    check, _ = ours(embedders["ours_float32"])()
    cosines = np.sum(_unit(check) * _unit(reference), axis=1)
    if cosines.min() < 0.99999:
        raise SystemExit(f"CLIP vectors differ from transformers' (cosine {cosines.min():.6f})")
    systems = {name: ours(e) for name, e in embedders.items()} | {"transformers": hf}
    seconds, _ = time_interleaved(systems, args.repeats)
    ratio = {
        name: [h / o for o, h in zip(seconds[name], seconds["transformers"], strict=True)]
        for name in embedders
    }
    return {
        "vision_tower": tower or "tiny",
        "images": len(images),
        "dtype_auto": str(embedders["ours_auto"].model.dtype),
        "min_cosine_float32": float(cosines.min()),
        "seconds": seconds,
        "images_per_second": {
            name: statistics.median(len(images) / s for s in v) for name, v in seconds.items()
        },
        "ratio_auto": spread(ratio["ours_auto"]),
        "ratio_float32": spread(ratio["ours_float32"]),
    }


def _unit(vectors: np.ndarray) -> np.ndarray:
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def run(args: argparse.Namespace, model_dir: Path) -> dict:
    import torch
    import transformers

    from backend_lib.multimodal.images import ImageLimits, decode_image
    from bench.llm import check_same, new_engine

    device, _, dtype = cli.setup_torch(args)
    preset = PRESETS[cli.mode(args.quick, device)]
    build_llava(model_dir, args.seed, preset.sizes)
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    processor.tokenizer.padding_side = "left"
    model = transformers.LlavaForConditionalGeneration.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    )
    model = model.to(device).eval()
    pictures = encoded_pictures(preset.pictures, args.seed)
    images = [decode_image(p, ImageLimits()) for p in pictures]
    requests = workload(preset, processor, args.seed)
    settings = {"max_model_len": 1024, "max_num_seqs": preset.requests}
    progress(
        f"{NAME}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {dtype} "
        f"on {device}; {preset.requests} requests over {preset.pictures} images"
    )

    cache_rates = []

    def engine_run() -> tuple[list[list[int]], float]:
        engine = new_engine(model_dir, device, dtype, **settings)
        try:
            started = time.perf_counter()
            tokens = run_engine(engine, requests, images, preset.output_len)
            seconds = time.perf_counter() - started
            cache = engine.runner.encoder_cache
            cache_rates.append(cache.hits / max(1, cache.hits + cache.misses))
            return tokens, seconds
        finally:
            engine.close()

    def hf_run() -> tuple[list[list[int]], float]:
        started = time.perf_counter()
        tokens = hf_generate(model, processor, requests, images, preset.output_len, True)
        return tokens, time.perf_counter() - started

    alone = hf_generate(model, processor, requests, images, preset.output_len, False)
    fidelity = check_same("hf_generate_alone", alone, {"engine": engine_run()[0]}, dtype)
    seconds, outputs = time_interleaved({"engine": engine_run, "hf_generate": hf_run}, args.repeats)
    from bench.llm import agreement

    fidelity["hf_generate_batched_agreement"] = agreement(alone, outputs["hf_generate"])
    tokens = preset.requests * preset.output_len
    ratios = [h / e for e, h in zip(seconds["engine"], seconds["hf_generate"], strict=True)]
    clip = clip_run(preset, model_dir.parent, pictures, args, dtype)
    return {
        "device": str(device),
        "dtype": dtype,
        "model": {**asdict(preset.sizes), "parameters": sum(p.numel() for p in model.parameters())},
        "workload": {
            "requests": preset.requests,
            "pictures": preset.pictures,
            "images": sum(len(r.pictures) for r in requests),
            "output_len": preset.output_len,
            "seed": args.seed,
        },
        "settings": {"engine": settings, "torch_threads": args.threads},
        "repeats": args.repeats,
        "seconds": seconds,
        "output_tokens_per_second": {
            name: statistics.median(tokens / s for s in values) for name, values in seconds.items()
        },
        "vlm_ratio": spread(ratios),
        "encoder_cache_hit_rate": statistics.median(cache_rates),
        "fidelity": fidelity,
        "clip": clip,
        "summary": {
            "vlm_vs_hf_generate": statistics.median(ratios),
            "encoder_cache_hit_rate": statistics.median(cache_rates),
            "clip_image_embedding_vs_transformers": clip["ratio_auto"]["median"],
        },
    }


def report(result: dict) -> list[str]:
    w, rates = result["workload"], result["output_tokens_per_second"]
    ratio = result["summary"]["vlm_vs_hf_generate"]
    return [
        f"{w['requests']} chat requests with {w['images']} images drawn from {w['pictures']} "
        f"distinct pictures, {w['output_len']} greedy tokens each; {result['repeats']} repeat(s), "
        f"alternating order, {result['dtype']} on {result['device']}. The engine's tokens equal "
        "transformers' unpadded generate for every request.",
        "",
        "| system | output tokens/s (median) |",
        "|---|---|",
        f"| engine (16 at once) | {rates['engine']:.1f} |",
        f"| transformers generate (one batch of 16) | {rates['hf_generate']:.1f} |",
        "",
        f"Encoder cache hit rate: {result['encoder_cache_hit_rate']:.2f} (each distinct picture "
        "encoded once).",
        summary_line("vlm_vs_hf_generate", ratio, VLM_TARGET.text, VLM_TARGET.met(ratio)),
        "",
        *clip_report(result["clip"]),
    ]


def clip_report(clip: dict) -> list[str]:
    rates, auto = clip["images_per_second"], clip["ratio_auto"]["median"]
    return [
        f"CLIP image embeddings, {clip['images']} images (vision tower {clip['vision_tower']}): "
        f"the embedding model's path vs transformers' processor and `get_image_features` "
        f"({CLIP_BATCH} a call, float32); vectors equal (cosine >= "
        f"{clip['min_cosine_float32']:.6f} in float32).",
        "",
        "| system | images/s (median) |",
        "|---|---|",
        f"| ours, dtype auto ({clip['dtype_auto']}) | {rates['ours_auto']:.1f} |",
        f"| ours, float32 | {rates['ours_float32']:.1f} |",
        f"| transformers, float32 | {rates['transformers']:.1f} |",
        "",
        f"Ours in float32 vs transformers: {clip['ratio_float32']['median']:.2f}x.",
        summary_line(
            "clip_image_embedding_vs_transformers", auto, CLIP_TARGET.text, CLIP_TARGET.met(auto)
        ),
    ]


BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report)

if __name__ == "__main__":
    BENCHMARK.main()
