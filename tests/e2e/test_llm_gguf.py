"""End to end: an llm whose `model` is a GGUF file (the Shakespeare model written by
tooling/gguf_checkpoints.py, Q4_0 projections loaded as stored) served by a real tritonserver
gives the greedy text of transformers on the same file (`gguf_file=`)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.e2e.llm_client import http_generate
from tests.llm.shakespeare_helpers import SHAKESPEARE
from tooling.gguf_checkpoints import write_gguf
from tooling.hf_reference import hf_greedy
from tooling.repository import ModelSpec, write_model

pytestmark = pytest.mark.e2e

PROMPT = "JULIET:\nO Romeo, Romeo! wherefore art thou"
NUM_TOKENS = 16


def test_a_gguf_llm_serves_transformers_greedy_text(tmp_path, make_server):
    path = write_gguf(SHAKESPEARE, tmp_path / "shakespeare-q4_0.gguf", "Q4_0")
    parameters = {
        "model": str(path),
        "dtype": "float32",
        "cpu_kv_cache_gb": "0.05",
        "max_num_seqs": "8",
        "max_model_len": "256",
    }
    write_model(ModelSpec("llm", "llm", parameters, max_batch_size=0), tmp_path / "repo")
    server = make_server(tmp_path / "repo", env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    params = json.dumps({"temperature": 0, "max_tokens": NUM_TOKENS, "ignore_eos": True})
    body = {"text_input": PROMPT, "sampling_parameters": params, "exclude_input_in_output": True}
    served = http_generate(server.http_url, body)

    source = {"pretrained_model_name_or_path": tmp_path, "gguf_file": path.name}
    tokenizer = AutoTokenizer.from_pretrained(**source)
    reference = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    tokens = hf_greedy(reference, tokenizer(PROMPT).input_ids, NUM_TOKENS)
    assert served["text_output"] == tokenizer.decode(tokens)
