"""Gemma and Phi-3 specifics the shared model tests (test_models.py) do not pin down on their own:
a tied Gemma head over the scaled embedding, the (1 + w) norm folding, the C++ step binding
serving Gemma, and Phi-3's LongRoPE tables against transformers' (short and long factors, the
attention factor, the static choice between them)."""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from backend_lib.llm.execution.attention import select_kernel_ops
from backend_lib.llm.execution.loader import load_model
from backend_lib.llm.execution.models.phi3 import Phi3ForCausalLM
from backend_lib.llm.execution.models.step_kernels import CppKernels
from kernels.rotary import rope_cos_sin_cache
from tooling.checkpoints import hf_config
from tooling.hf_reference import hf_next_logits


def _load(model_dir):
    return load_model(
        model_dir,
        torch.device("cpu"),
        torch.float32,
        select_kernel_ops("torch", "cpu"),
        pack_linear_weights=False,  # to inspect the weights themselves
    )


def test_tied_gemma_head_and_folded_norms_match_hf(checkpoint, session):
    model_dir, hf = checkpoint("Gemma2ForCausalLM", tie_word_embeddings=True)
    model = _load(model_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    stored = model.model.layers[1].post_feedforward_layernorm.weight
    want = 1.0 + hf.model.layers[1].post_feedforward_layernorm.weight
    torch.testing.assert_close(stored, want, atol=0, rtol=0)
    s = session(model_dir)
    kinds = []
    step_kernels = s.runner.model.step_kernels
    s.runner.model.step_kernels = lambda *a: kinds.append(type(k := step_kernels(*a))) or k
    prompt = torch.randint(3, 256, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    seq = s.add(prompt)
    logits = s.logits([(seq, None)])
    torch.testing.assert_close(logits[0], hf_next_logits(hf, prompt), atol=1e-4, rtol=1e-4)
    assert kinds == [CppKernels]  # the C++ ops (GELU, soft-capped attention) served the step


def _hf_longrope_table(config, seq_len: int) -> torch.Tensor:
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
    freqs = torch.arange(seq_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor


def test_longrope_tables_match_transformers():
    config = hf_config("Phi3ForCausalLM")
    args = Phi3ForCausalLM.args_from_config(config.to_dict())
    original = config.original_max_position_embeddings

    def ours(max_position: int) -> torch.Tensor:
        return rope_cos_sin_cache(
            args.head_dim, max_position, args.rope_theta, args.rope_scaling, torch.float32, "cpu"
        )

    # Within the original context: the short factors (transformers' choice for such lengths).
    short = _hf_longrope_table(config, original)
    torch.testing.assert_close(ours(original), short, atol=1e-6, rtol=1e-6)
    # A longer table: the long factors for every position (transformers uses them once the
    # sequence is longer than the original context).
    long = _hf_longrope_table(config, original + 40)
    torch.testing.assert_close(ours(original + 40), long, atol=1e-6, rtol=1e-6)
    assert (short - long[:original]).abs().max() > 0.1


def test_phi3_partial_rotary_factor_matches_hf(checkpoint, session):
    model_dir, hf = checkpoint(
        "Phi3ForCausalLM",
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
    )
    s = session(model_dir)
    args = s.runner.model.args
    assert args.rotary_dim == args.head_dim // 2 == s.runner.model.rope_cache.shape[1]
    prompt = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(2)).tolist()
    logits = s.logits([(s.add(prompt), None)])
    torch.testing.assert_close(logits[0], hf_next_logits(hf, prompt), atol=1e-4, rtol=1e-4)
