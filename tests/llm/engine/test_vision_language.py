"""Vision-language models on the engine (Llava: CLIP tower, projector, Llama decoder; Qwen2-VL and
Qwen2.5-VL: dynamic-resolution towers, M-RoPE; Gemma 3: SigLIP tower, image tokens attended both
ways) against transformers' greedy `generate` on the same checkpoint and images: 1-3 images per
prompt batched with text-only prompts, an image split across prefill chunks (Gemma 3: chunks
around whole images), prefix hits on a repeated image, preemption by recompute; two different
images never share a prefix block."""

from __future__ import annotations

from dataclasses import replace

import pytest
import transformers

from backend_lib.errors import InputError
from backend_lib.multimodal.images import ImageLimits, decode_image
from tests.llm.engine_helpers import assert_pool_released, make_engine
from tests.llm.vlm_helpers import (
    FAMILIES,
    hf_image_greedy,
    image,
    image_request,
    run_all,
    vlm_checkpoint,
)
from tests.multimodal.image_helpers import encoded

pytestmark = pytest.mark.usefixtures("single_torch_thread")

PROMPTS = [
    ("USER: {img} What is this?\nASSISTANT:", 1),
    ("USER: {img} and {img} side by side\nASSISTANT:", 2),
    ("USER: {img}{img} then {img}\nASSISTANT:", 3),
    ("USER: No picture here, good sir.\nASSISTANT:", 0),
    ("ROMEO: But soft, what light", 0),
]


def _engine(family: str = "llava", **overrides):
    model_dir, _ = vlm_checkpoint(family)
    return make_engine(model_dir, **{"max_model_len": 256, **overrides})


def _prompt(template: str, family: str) -> str:
    return template.format(img=FAMILIES[family].placeholder)


def _requests(family: str, seed: int = 0, max_tokens: int = 8):
    requests, expected = [], {}
    for i, (template, count) in enumerate(PROMPTS):
        prompt = _prompt(template, family)
        images = [image(seed + 10 * i + j, 112 - 28 * j, 84) for j in range(count)]
        requests.append(image_request(f"r{i}", prompt, images, max_tokens))
        expected[f"r{i}"] = hf_image_greedy(prompt, images, max_tokens, family)
    return requests, expected


def _tokens(outputs) -> dict:
    return {rid: out.outputs[0].token_ids for rid, out in outputs.items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_images_batched_with_text_match_generate(family):
    engine = _engine(family)
    requests, expected = _requests(family)
    assert _tokens(run_all(engine, requests)) == expected
    assert engine.runner.encoder_cache.misses == 6  # every image encoded once
    assert_pool_released(engine)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_image_split_across_prefill_chunks_and_preempted(family):
    # 8-token chunks split the images (12 to 16 tokens each), except Gemma 3's, attended both
    # ways: its 20-token chunks end before an image and take it whole (16 tokens beside up to 3
    # decodes). A pool of 12 blocks of 8 cannot hold every prompt with its output, so some are
    # preempted and computed again.
    chunks = {"max_num_batched_tokens": 20, "max_num_seqs": 4} if family == "gemma3" else {}
    engine = _engine(
        family, **{"max_num_batched_tokens": 8, **chunks}, num_blocks=12, max_model_len=96
    )
    requests, expected = _requests(family, seed=100)
    assert _tokens(run_all(engine, requests)) == expected
    assert engine.stats().counters.num_preemptions > 0
    assert_pool_released(engine)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_repeated_image_hits_the_prefix_and_encoder_caches(family):
    engine = _engine(family)
    prompt = _prompt("USER: {img} and {img} again\nASSISTANT:", family)
    pictures = [image(7, 112, 84), image(8, 84, 112)]
    expected = hf_image_greedy(prompt, pictures, 8, family)
    first = run_all(engine, [image_request("a", prompt, pictures, 8)])["a"]
    encoded = engine.runner.encoder_cache.misses
    second = run_all(engine, [image_request("b", prompt, pictures, 8)])["b"]
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == expected
    assert second.num_cached_tokens >= len(second.prompt_token_ids) - 8  # all full blocks
    assert engine.runner.encoder_cache.misses == encoded  # nothing encoded again
    assert_pool_released(engine)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_different_images_with_equal_text_share_no_image_block(family):
    # Both prompts tokenize to the same ids (same-size images: the placeholders are equal); only
    # the image hash tells their blocks apart. Were it ignored, the second would reuse the
    # first's K/V.
    engine = _engine(family)
    prompt = _prompt("USER: {img} Tell me of it.\nASSISTANT:", family)
    first = run_all(engine, [image_request("a", prompt, [image(1, 112, 84)], 8)])["a"]
    second = run_all(engine, [image_request("b", prompt, [image(2, 112, 84)], 8)])["b"]
    assert first.prompt_token_ids == second.prompt_token_ids
    assert second.outputs[0].token_ids == hf_image_greedy(prompt, [image(2, 112, 84)], 8, family)
    assert first.outputs[0].token_ids != second.outputs[0].token_ids
    image_token = vlm_checkpoint(family)[1].config.image_token_id
    image_start = second.prompt_token_ids.index(image_token)
    assert second.num_cached_tokens == image_start // 8 * 8  # text blocks before the image only
    assert_pool_released(engine)


@pytest.mark.parametrize(
    "prompt, count, message",
    [
        ("USER: <image> <image>\nASSISTANT:", 1, r"2 image placeholders \(<image>\) for 1"),
        ("USER: <image>\nASSISTANT:", 2, r"1 image placeholders \(<image>\) for 2"),
        ("USER: <image>\nASSISTANT:", 0, "image placeholders .* but no images"),
        ("USER: <image>" * 3, 3, r"at most 2 are allowed \(limit_mm_per_prompt\)"),
    ],
    ids=["too-few-images", "too-many-placeholders", "no-images", "over-limit"],
)
def test_bad_image_prompts_fail_alone(prompt, count, message):
    engine = _engine(limit_mm_per_prompt='{"image": 2}')
    with pytest.raises(InputError, match=message):
        engine.add(image_request("bad", prompt, [image(i) for i in range(count)], 4))
    good = run_all(engine, [image_request("ok", "USER: <image>\nASSISTANT:", [image(5)], 4)])
    assert good["ok"].outputs[0].token_ids == hf_image_greedy(
        "USER: <image>\nASSISTANT:", [image(5)], 4
    )
    assert_pool_released(engine)


def test_a_thin_strip_is_refused_before_it_is_resized():
    # 2 x 60000 pixels pass the pixel limit as they are; resized to a 28-pixel short side they
    # would be 28 x 840000.
    engine = _engine()
    strip = decode_image(encoded(60000, 2), ImageLimits())
    with pytest.raises(InputError, match="aspect ratio is too extreme"):
        engine.add(image_request("strip", "USER: <image>\nASSISTANT:", [strip], 4))
    assert_pool_released(engine)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_token_id_prompt_takes_images_too(family):
    # The ids as the tokenizer gives them, one placeholder token per image.
    model_dir, _ = vlm_checkpoint(family)
    prompt = _prompt("USER: {img} and {img}\nASSISTANT:", family)
    ids = transformers.AutoTokenizer.from_pretrained(model_dir)(prompt)["input_ids"]
    pictures = [image(3, 112, 84), image(4, 56, 84)]
    engine = _engine(family)
    request = replace(image_request("t", "", pictures, 8), prompt=None, prompt_token_ids=ids)
    assert run_all(engine, [request])["t"].outputs[0].token_ids == hf_image_greedy(
        prompt, pictures, 8, family
    )
    assert_pool_released(engine)


def test_a_text_model_refuses_images():
    from tests.llm.engine_helpers import engine_checkpoint

    engine = make_engine(engine_checkpoint("LlamaForCausalLM")[0])
    with pytest.raises(InputError, match="takes no images"):
        engine.add(image_request("t", "hello", [image(1)], 4))


def test_settings_not_served_with_images_yet_are_refused_at_load():
    from backend_lib.config import ConfigError

    with pytest.raises(ConfigError, match="enable_lora.*not served with images yet"):
        _engine(enable_lora=True)
    with pytest.raises(ConfigError, match="tensor_parallel_size.*not sharded yet"):
        _engine(tensor_parallel_size=2)


def test_64_image_requests_at_the_pixel_limit_hold_only_processed_tensors():
    # Memory per queued image request is its processed tensors (a 28 x 28 crop here), never the
    # decoded picture at the pixel limit; the encoder cache stays within its rows.
    limit = 512 * 512
    engine = _engine(max_image_pixels=limit, encoder_cache_size=64, max_num_seqs=8)
    limits = ImageLimits(max_image_pixels=limit)
    prompt = "USER: <image> What is it?\nASSISTANT:"
    pictures = [decode_image(encoded(512, 512, seed=s), limits) for s in range(64)]
    requests = [image_request(f"r{i}", prompt, [p], 2) for i, p in enumerate(pictures)]
    for request in requests:
        engine.add(request)
    queued = [seq.request for seq in engine.scheduler.waiting]
    assert len(queued) == 64 and all(r.images == () for r in queued)
    held = sum(t.nbytes for r in queued for f in r.mm_features for t in f.data.values())
    assert held == 64 * 3 * 28 * 28 * 4  # float32 pixel values, nothing else
    outputs = run_all(engine, [])
    assert len(outputs) == 64
    cache = engine.runner.encoder_cache
    assert cache.misses == 64 and len(cache) <= 64 // 16  # 16 rows an image, 64 rows kept
    assert_pool_released(engine)


def test_gemma3_images_attended_both_ways_through_the_triton_kernels():
    # The Triton kernel (its interpreter on CPU) takes `visible_until` as the PyTorch path does:
    # the same greedy tokens as transformers, an image in a chunk after a cached prefix included.
    engine = _engine("gemma3", kernel_backend="triton", max_num_batched_tokens=24, max_num_seqs=4)
    prompt = _prompt("USER: {img} and {img}\nASSISTANT:", "gemma3")
    pictures = [image(11, 112, 84), image(12, 56, 84)]
    expected = hf_image_greedy(prompt, pictures, 6, "gemma3")
    for rid in ("a", "b"):  # "b" reads "a"'s prefix blocks
        out = run_all(engine, [image_request(rid, prompt, pictures, 6)])[rid]
        assert out.outputs[0].token_ids == expected
    assert out.num_cached_tokens > 0
    assert_pool_released(engine)


def test_gemma3_refuses_a_step_budget_that_cannot_hold_an_image():
    from backend_lib.config import ConfigError

    # 16 image tokens beside up to 7 decodes need 23.
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens.*>= 23.*16 tokens"):
        _engine("gemma3", max_num_batched_tokens=22, max_num_seqs=8)


def test_gemma3_prompt_errors_name_its_tokens():
    engine = _engine("gemma3")
    soft = "USER: <image_soft_token> <start_of_image>\nASSISTANT:"
    with pytest.raises(InputError, match=r"image tokens \(<image_soft_token>\) of its own"):
        engine.add(image_request("own", soft, [image(1)], 4))
    with pytest.raises(InputError, match=r"placeholders \(<start_of_image>\) but no images"):
        engine.add(image_request("none", "USER: <start_of_image>\nASSISTANT:", [], 4))
    assert_pool_released(engine)


def test_gemma3_pan_and_scan_is_refused_at_load(tmp_path):
    import json
    import shutil

    from backend_lib.config import ConfigError

    model_dir = tmp_path / "gemma3"
    shutil.copytree(vlm_checkpoint("gemma3")[0], model_dir)
    config = model_dir / "processor_config.json"
    fields = json.loads(config.read_text())
    fields["image_processor"]["do_pan_and_scan"] = True
    config.write_text(json.dumps(fields))
    with pytest.raises(ConfigError, match="do_pan_and_scan"):
        make_engine(model_dir)
