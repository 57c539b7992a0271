"""Random-weight vision-language checkpoints with their processors, built offline with
transformers for the tests and benchmarks: tiny Llava (CLIP tower, Llama decoder), Qwen2-VL /
Qwen2.5-VL and Gemma 3 (SigLIP tower) models over the Shakespeare tokenizer, their image tokens
added."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from tooling.checkpoints import SHAKESPEARE_DIR, randomize_

IMAGE_TOKEN = "<image>"

LLAVA_CHAT_TEMPLATE = """\
{%- for message in messages -%}
{{ message['role'] | upper }}: \
{%- if message['content'] is string -%}
{{ ' ' + message['content'] }}
{%- else -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'text' %} {{ part['text'] }}\
{%- elif part['type'] in ('image', 'image_url') %} <image>{%- endif -%}
{%- endfor -%}
{%- endif %}
{% endfor -%}
{%- if add_generation_prompt -%}ASSISTANT:{%- endif -%}
"""
"""llava-hf's chat form ("USER: <image> text\\nASSISTANT:"): image parts become placeholders."""


@dataclass(frozen=True)
class LlavaSizes:
    """The shape of a random Llava: its CLIP tower and its Llama decoder."""

    vision_hidden: int = 32
    vision_layers: int = 2
    image_size: int = 28
    """Pixels of the square the image processor resizes and crops to."""
    patch_size: int = 7
    text_hidden: int = 64
    text_layers: int = 2


TINY = LlavaSizes()
"""The tests' Llava: 16 placeholder tokens per image, a 2-layer decoder of width 64."""


def build_llava(
    out_dir: Path,
    seed: int = 0,
    sizes: LlavaSizes = TINY,
    select_strategy: str = "default",
) -> Path:
    """A random `LlavaForConditionalGeneration` (CLIP vision tower, Llama decoder) of `sizes` and
    its `LlavaProcessor` (CLIP image processor), saved to `out_dir`: (image_size /
    patch_size)^2 placeholder tokens per image under the "default" strategy (CLS dropped), one
    more under "full". The tiny one's parameters are all redrawn wide (`randomize_`: every
    variant visibly changes the output); a larger one keeps transformers' initialisation at a
    0.06 spread (clearly separated logits, so greedy paths are robust to rounding)."""
    image_size, patch_size = sizes.image_size, sizes.patch_size
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(SHAKESPEARE_DIR)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    vision = transformers.CLIPVisionConfig(
        hidden_size=sizes.vision_hidden,
        intermediate_size=2 * sizes.vision_hidden,
        num_hidden_layers=sizes.vision_layers,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=patch_size,
    )
    text = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=sizes.text_hidden,
        intermediate_size=2 * sizes.text_hidden,
        num_hidden_layers=sizes.text_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.06,
    )
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=-2,
        vision_feature_select_strategy=select_strategy,
    )
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config)
    if sizes == TINY:
        randomize_(model, seed)
    model.save_pretrained(out_dir)
    image_processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy=select_strategy,
        num_additional_image_tokens=1,
        image_token=IMAGE_TOKEN,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)
    return out_dir


QWEN2_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

QWEN2_VL_CHAT_TEMPLATE = """\
{%- for message in messages -%}
<|im_start|>{{ message['role'] }}
{% if message['content'] is string -%}
{{ message['content'] }}
{%- else -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'text' -%}{{ part['text'] }}
{%- elif part['type'] in ('image', 'image_url') -%}<|vision_start|><|image_pad|><|vision_end|>
{%- endif -%}
{%- endfor -%}
{%- endif %}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
{% endif -%}
"""
"""Qwen2-VL's chat form: each image part is <|vision_start|><|image_pad|><|vision_end|>."""


def build_qwen2_vl(out_dir: Path, seed: int = 0, version: str = "2") -> Path:
    """A tiny random `Qwen2VLForConditionalGeneration` (version "2") or
    `Qwen2_5_VLForConditionalGeneration` ("2.5": window attention in the tower) with M-RoPE
    (sections 2, 3, 3 of 8 frequencies) over the Shakespeare tokenizer (Qwen2-VL's vision tokens
    added), its image processor (14-pixel patches, 2 x 2 merge, 56^2 to 28^2 x 64 pixels) and
    chat template, saved to `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(SHAKESPEARE_DIR)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN2_VL_TOKENS)})
    start, end, image, video = tokenizer.convert_tokens_to_ids(list(QWEN2_VL_TOKENS))
    vision = dict(
        depth=2,
        hidden_size=32 if version == "2.5" else 64,
        num_heads=4,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        in_channels=3,
    )
    if version == "2.5":
        vision |= dict(out_hidden_size=64, intermediate_size=64, window_size=56)
        vision |= dict(fullatt_block_indexes=[1])
    else:
        vision |= dict(embed_dim=32, mlp_ratio=2)
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    family = {
        "2": (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration),
        "2.5": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration),
    }
    config_class, model_class = family[version]
    config = config_class(
        vision_config=vision,
        text_config=text,
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
    )
    torch.manual_seed(seed)
    model = model_class(config)
    randomize_(model, seed)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "chat_template.jinja").write_text(QWEN2_VL_CHAT_TEMPLATE, encoding="utf-8")
    image_processor = transformers.Qwen2VLImageProcessor(
        min_pixels=56 * 56, max_pixels=28 * 28 * 64
    )
    image_processor.save_pretrained(out_dir)
    return out_dir


GEMMA3_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}

GEMMA3_CHAT_TEMPLATE = """\
{%- for message in messages -%}
<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}
{% if message['content'] is string -%}
{{ message['content'] }}
{%- else -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'text' -%}{{ part['text'] }}
{%- elif part['type'] in ('image', 'image_url') -%}<start_of_image>
{%- endif -%}
{%- endfor -%}
{%- endif %}<end_of_turn>
{% endfor -%}
{%- if add_generation_prompt -%}<start_of_turn>model
{% endif -%}
"""
"""Gemma 3's chat form: each image part is <start_of_image>, which the processor expands."""


def build_gemma3(out_dir: Path, seed: int = 0) -> Path:
    """A tiny random `Gemma3ForConditionalGeneration` over the Shakespeare tokenizer (Gemma 3's
    image tokens added): a SigLIP tower on 56-pixel images in 7-pixel patches (8 x 8), pooled 2 x 2
    to 16 image tokens, which attend to each other both ways; a 2-layer Gemma 3 decoder, its
    first layer sliding (window 24, wider than an image), and its `Gemma3Processor` (image
    processor and chat template), saved to `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        SHAKESPEARE_DIR, extra_special_tokens=GEMMA3_TOKENS
    )
    boi, eoi, image = tokenizer.convert_tokens_to_ids(list(GEMMA3_TOKENS.values()))
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=56,
        patch_size=7,
        vision_use_head=False,  # as Gemma 3's own tower
    )
    text = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=20,
        sliding_window=24,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config = transformers.Gemma3Config(
        vision_config=vision,
        text_config=text,
        mm_tokens_per_image=16,
        boi_token_index=boi,
        eoi_token_index=eoi,
        image_token_index=image,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config)
    randomize_(model, seed)
    with torch.no_grad():
        # Token embeddings and image rows both about 0.8 in std (after Gemma's sqrt(hidden)
        # scaling of the tokens), below what each layer adds: so every image, and its tokens
        # attending to each other both ways, visibly change the output.
        model.model.language_model.embed_tokens.weight.mul_(0.1)
        model.model.multi_modal_projector.mm_input_projection_weight.mul_(0.5)
    model.save_pretrained(out_dir)
    image_processor = transformers.Gemma3ImageProcessor(size={"height": 56, "width": 56})
    processor = transformers.Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_length=16,
        chat_template=GEMMA3_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)
    return out_dir
