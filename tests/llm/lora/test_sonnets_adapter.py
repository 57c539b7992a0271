"""The shipped LoRA adapter (models/shakespeare-sonnets-lora, trained by
`scripts/train_shakespeare.py --lora`): PEFT format, safetensors, at most 2 MB, listed in the
default llm model's multi_lora.json, and served by the engine exactly as PEFT runs it."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaForCausalLM

from backend_lib.llm.config import LLMConfig
from backend_lib.llm.engine.llm_engine import LLMEngine
from tests.llm.engine_helpers import greedy
from tests.llm.shakespeare_helpers import SHAKESPEARE, SONNETS_ADAPTER
from tooling.hf_reference import hf_greedy
from tooling.repository import REPO_ROOT

PROMPT = "Shall I compare thee"

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_adapter_files_and_listing():
    files = sorted(p.name for p in SONNETS_ADAPTER.iterdir())
    assert files == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert (SONNETS_ADAPTER / "adapter_model.safetensors").stat().st_size <= 2 * 1024 * 1024
    listing = json.loads((REPO_ROOT / "model_repository/llm/1/multi_lora.json").read_text())
    assert (REPO_ROOT / "model_repository/llm" / listing["sonnets"]).resolve() == SONNETS_ADAPTER


def test_engine_serves_the_adapter_as_peft_runs_it():
    peft = pytest.importorskip("peft")
    config = LLMConfig(
        model=str(SHAKESPEARE),
        dtype="float32",
        kernel_backend="torch",
        num_blocks=64,
        max_model_len=256,
        enable_lora=True,
        max_lora_rank=16,
    )
    config.validate()
    engine = LLMEngine(
        config, SHAKESPEARE, torch.device("cpu"), lora_modules={"sonnets": SONNETS_ADAPTER}
    )
    ids = engine.tokenizer(PROMPT)["input_ids"]
    base, sonnets = engine.generate([ids, ids], greedy(24), lora_names=[None, "sonnets"])
    hf = LlamaForCausalLM.from_pretrained(SHAKESPEARE, dtype=torch.float32, local_files_only=True)
    reference = peft.PeftModel.from_pretrained(hf, SONNETS_ADAPTER).eval()
    assert sonnets.outputs[0].token_ids == hf_greedy(reference, ids, 24)
    assert sonnets.outputs[0].token_ids != base.outputs[0].token_ids
