"""Engine-level test helpers: a tiny tokenizer, tiny checkpoints with it, an engine factory,
prompts and greedy params, and the KV pool invariant every engine test ends with."""

from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.engine.llm_engine import LLMEngine
from tests.llm.config_helpers import llm_config
from tooling.checkpoints import build_checkpoint

VOCAB = 256  # tooling.checkpoints' vocab_size
_SYLLABLES = [
    "ka",
    "ro",
    "mi",
    "te",
    "lu",
    "sa",
    "ven",
    "tor",
    "al",
    "is",
    "qu",
    "bre",
    "on",
    "di",
    "ex",
    "po",
    "ga",
    "ny",
    "shi",
    "zu",
]


def tiny_tokenizer() -> Tokenizer:
    """A SentencePiece-style BPE (Metaspace) with exactly VOCAB tokens, <s>=1 prepended like
    Llama's; every token decodes to clean ASCII, so random outputs have readable text."""
    rng = random.Random(0)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(400)]
    corpus = [
        " ".join(rng.choice(words) for _ in range(12)) + rng.choice(".,!?") for _ in range(200)
    ]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"])
    )
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert tok.get_vocab_size() == VOCAB
    return tok


def _save_tokenizer(out_dir: Path) -> None:
    tiny_tokenizer().save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
            }
        )
    )


_BUILT: dict[str, tuple[Path, transformers.PreTrainedModel]] = {}


def engine_checkpoint(arch: str) -> tuple[Path, transformers.PreTrainedModel]:
    """(dir, HF model) of a tiny `arch` checkpoint with a tokenizer; built once per process."""
    if arch not in _BUILT:
        out = Path(tempfile.mkdtemp(prefix=f"engine-{arch}-"))
        atexit.register(shutil.rmtree, out, ignore_errors=True)
        model = build_checkpoint(arch, out)
        _save_tokenizer(out)
        _BUILT[arch] = (out, model)
    return _BUILT[arch]


TEST_DEVICE = torch.device(os.environ.get("LLM_TEST_DEVICE", "cpu"))
"""Where the engine tests run: the CPU, or with LLM_TEST_DEVICE=cuda (make gpu-check) the GPU
with the Triton kernels; the transformers references stay on the CPU."""


def make_engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    """Engine on TEST_DEVICE (the CPU: PyTorch kernels), float32, block 8, 64 blocks,
    max_model_len 128."""
    if TEST_DEVICE.type == "cuda":
        overrides.setdefault("kernel_backend", "triton")
    return LLMEngine(llm_config(model_dir, **overrides), model_dir, TEST_DEVICE)


def random_prompt(length: int, seed: int) -> list[int]:
    """Token ids avoiding the special tokens 0-2."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=gen).tolist()


def greedy(max_tokens: int | None, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def assert_pool_released(engine: LLMEngine) -> None:
    """Nothing left running and every KV block back: ref counts 0, free (cached or not) == pool."""
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.has_unfinished()
    kv = engine.scheduler.kv_cache_manager
    for pool in (kv.pool, kv.host_pool):
        assert all(block.ref_count == 0 for block in pool.blocks)
        assert pool.num_free_blocks == pool.num_blocks
        assert pool.num_cached_blocks <= pool.num_blocks
    assert engine.stats().kv_cache_usage == 0.0
    draft = engine.runner.draft  # speculative decoding's draft model: its own pool
    if draft is not None:
        assert draft.num_free_blocks == draft.kv_pool.num_blocks


def output_ids(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in engine.generate(prompts, params)]


def run_in_two_waves(engine: LLMEngine, requests: list, first: int, steps_between: int = 3) -> dict:
    """Add `requests[:first]`, step `steps_between` times, add the rest, then step until every
    request finished; the final outputs by request id."""
    for request in requests[:first]:
        engine.add(request)
    outputs = {}
    for _ in range(steps_between):
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    for request in requests[first:]:
        engine.add(request)
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    return outputs
