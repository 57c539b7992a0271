"""Random-weight vision-language checkpoints with their processors, built offline with
transformers for the tests and benchmarks: a tiny Llava (CLIP tower, Llama decoder) over the
Shakespeare tokenizer with an `<image>` token added."""

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
    more under "full"."""
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
