"""End to end: llms whose `model` is a GGUF file, written by tooling/gguf_checkpoints.py as
llama.cpp writes them, served side by side by a real tritonserver: the Shakespeare Llama and a
random Qwen2 as llama.cpp's Q4_K_M mix (Q4_K, with attn_v and ffn_down in Q6_K), a random Gemma 2
in Q8_0, each loaded as stored. Each gives the greedy text of transformers on the same file
(`gguf_file=`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.e2e.llm_client import http_generate
from tests.llm.shakespeare_helpers import SHAKESPEARE
from tooling.gguf_checkpoints import build_family_checkpoint, write_gguf
from tooling.hf_reference import hf_greedy
from tooling.repository import ModelSpec, write_model

pytestmark = pytest.mark.e2e

PROMPT = "JULIET:\nO Romeo, Romeo! wherefore art thou"
NUM_TOKENS = 16
Q4_K_M = {"tensor_type": {"attn_v": "Q6_K", "ffn_down": "Q6_K"}, "default_type": "Q4_K"}


def _files(root: Path) -> dict[str, Path]:
    """Model name -> its GGUF file."""
    return {
        "llama": write_gguf(SHAKESPEARE, root / "llama-q4_k_m.gguf", **Q4_K_M),
        "qwen2": write_gguf(
            build_family_checkpoint("Qwen2ForCausalLM", root / "qwen2"),
            root / "qwen2-q4_k_m.gguf",
            **Q4_K_M,
        ),
        "gemma2": write_gguf(
            build_family_checkpoint("Gemma2ForCausalLM", root / "gemma2"),
            root / "gemma2-q8_0.gguf",
            "Q8_0",
        ),
    }


def test_gguf_llms_serve_transformers_greedy_text(tmp_path, make_server):
    files = _files(tmp_path)
    for name, path in files.items():
        parameters = {
            "model": str(path),
            "dtype": "float32",
            "cpu_kv_cache_gb": "0.05",
            "max_num_seqs": "8",
            "max_model_len": "256",
        }
        write_model(ModelSpec(name, "llm", parameters, max_batch_size=0), tmp_path / "repo")
    server = make_server(tmp_path / "repo", env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    params = json.dumps({"temperature": 0, "max_tokens": NUM_TOKENS, "ignore_eos": True})
    body = {"text_input": PROMPT, "sampling_parameters": params, "exclude_input_in_output": True}
    for name, path in files.items():
        served = http_generate(server.http_url, body, model=name)
        source = {"pretrained_model_name_or_path": tmp_path, "gguf_file": path.name}
        tokenizer = AutoTokenizer.from_pretrained(**source)
        reference = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
        tokens = hf_greedy(reference, tokenizer(PROMPT).input_ids, NUM_TOKENS)
        assert served["text_output"] == tokenizer.decode(tokens, skip_special_tokens=True), name
