"""Llama-family models over the paged KV cache against Hugging Face transformers (float32)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend_lib.config import ConfigError
from backend_lib.llm.execution.attention import select_kernel_ops
from backend_lib.llm.execution.loader import load_model
from backend_lib.llm.execution.models import supported_architectures
from tests.llm.config_helpers import BLOCK_SIZE
from tooling.checkpoints import build_checkpoint
from tooling.hf_reference import hf_greedy, hf_next_logits

ATOL = RTOL = 1e-4

VARIANTS = {
    "llama-llama3-rope": ("LlamaForCausalLM", {}),
    "llama-biases-tied": (
        "LlamaForCausalLM",
        dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    ),
    "mistral-sliding-window": ("MistralForCausalLM", {}),
    "qwen2-qkv-bias-tied": ("Qwen2ForCausalLM", {}),
    "qwen2-sliding-upper-layers": (
        "Qwen2ForCausalLM",
        dict(
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-qk-norm-mqa": ("Qwen3ForCausalLM", {}),
    "gemma2-softcaps-alternating-windows": ("Gemma2ForCausalLM", {}),
    "gemma3-qk-norm-local-global-rope": ("Gemma3ForCausalLM", {}),
    "phi3-fused-longrope": ("Phi3ForCausalLM", {}),
}


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (length,), generator=gen).tolist()


def _assert_rows_match_hf(logits: torch.Tensor, seqs, hf) -> None:
    assert logits.shape[0] == len(seqs)
    for row, seq in zip(logits, seqs, strict=True):
        torch.testing.assert_close(row, hf_next_logits(hf, seq.token_ids), atol=ATOL, rtol=RTOL)


@pytest.fixture(params=list(VARIANTS), ids=list(VARIANTS))
def variant(request, checkpoint):
    arch, overrides = VARIANTS[request.param]
    return checkpoint(arch, **overrides)


def test_batched_prefill_then_decode_matches_hf(variant, session):
    model_dir, hf = variant
    s = session(model_dir)
    # Lengths around block boundaries (block size 8), one single-token prompt.
    seqs = [s.add(_prompt(n, seed=n)) for n in (5, 16, 17, 1)]
    logits = s.logits([(q, None) for q in seqs])
    _assert_rows_match_hf(logits, seqs, hf)
    for _ in range(5):
        for q, token in zip(seqs, logits.argmax(-1).tolist(), strict=True):
            q.append_token(token)
        logits = s.logits([(q, 1) for q in seqs])
        _assert_rows_match_hf(logits, seqs, hf)


def test_chunked_prefill_mixed_with_decodes_matches_hf(variant, session):
    model_dir, hf = variant
    s = session(model_dir)
    long, short, late = s.add(_prompt(19, 1)), s.add(_prompt(6, 2)), s.add(_prompt(10, 3))
    # step: (chunks, sequences expected to sample, in batch order)
    plan = [
        ([(long, 3), (short, None)], [short]),
        ([(short, 1), (long, 8), (late, 4)], [short]),
        ([(long, 8), (late, None), (short, 1)], [long, late, short]),
        ([(late, 1), (long, 1), (short, 1)], [late, long, short]),
    ]
    for chunks, samplers in plan:
        logits = s.logits(chunks)
        _assert_rows_match_hf(logits, samplers, hf)
        for q, token in zip(samplers, logits.argmax(-1).tolist(), strict=True):
            q.append_token(token)


def test_greedy_execute_matches_generate(variant, session):
    """The full step path (execute + sampler, greedy) reproduces `generate` token for token."""
    model_dir, hf = variant
    s = session(model_dir)
    prompts = [_prompt(n, seed=10 + n) for n in (3, 12, 21)]
    seqs = [s.add(p) for p in prompts]
    num_new = 6
    s.step([(seqs[0], None), (seqs[2], 9)])  # third prompt chunked: 9, then 12
    s.step([(seqs[0], 1), (seqs[1], None), (seqs[2], None)])
    while any(q.num_output_tokens < num_new for q in seqs):
        s.step([(q, 1) for q in seqs if q.num_output_tokens < num_new])
    for q, p in zip(seqs, prompts, strict=True):
        assert q.token_ids[len(p) :] == hf_greedy(hf, p, num_new)


def test_prefix_shared_through_block_tables_matches_hf(variant, session):
    model_dir, hf = variant
    s = session(model_dir)
    prefix = _prompt(2 * BLOCK_SIZE, seed=5)
    first = s.add(prefix + _prompt(5, seed=6))
    second = s.add(prefix + _prompt(3, seed=7))
    _assert_rows_match_hf(s.logits([(first, None)]), [first], hf)
    # The second sequence reuses the first's two full prefix blocks and computes only its tail.
    second.block_table = first.block_table[:2]
    second.num_computed_tokens = len(prefix)
    _assert_rows_match_hf(s.logits([(second, None)]), [second], hf)
    for q in (first, second):
        q.append_token(7)
    _assert_rows_match_hf(s.logits([(first, 1), (second, 1)]), [first, second], hf)


@pytest.mark.parametrize(
    "name",
    [
        "mistral-sliding-window",
        "qwen3-qk-norm-mqa",
        # Softcaps in the Triton attention kernel, GELU(tanh)-and-mul (Gemma 3 adds nothing
        # kernel-side: the same norm and rotary kernels with other weights and tables).
        "gemma2-softcaps-alternating-windows",
        "phi3-fused-longrope",
    ],
)
def test_triton_kernels_match_hf(name, checkpoint, session):
    """The GPU kernel set end to end: on CUDA when present, else in Triton's interpreter
    (tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA)."""
    model_dir, hf = checkpoint(VARIANTS[name][0], **VARIANTS[name][1])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s = session(model_dir, device=device, kernel_backend="triton")
    seqs = [s.add(_prompt(n, seed=n)) for n in (9, 17)]
    _assert_rows_match_hf(s.logits([(q, None) for q in seqs]).cpu(), seqs, hf)
    for q in seqs:
        q.append_token(11)
    _assert_rows_match_hf(s.logits([(q, 1) for q in seqs]).cpu(), seqs, hf)


def test_bfloat16_on_cpu_close_to_float32(checkpoint, session):
    model_dir, hf = checkpoint("LlamaForCausalLM")
    s = session(model_dir, dtype="bfloat16")
    seqs = [s.add(_prompt(n, seed=n)) for n in (7, 18)]
    logits = s.logits([(q, None) for q in seqs])
    assert logits.dtype == torch.float32
    assert s.runner.model.model.embed_tokens.weight.dtype == torch.bfloat16
    for row, q in zip(logits, seqs, strict=True):
        ref = hf_next_logits(hf, q.token_ids)
        err = (row - ref).abs().max().item()
        assert err < 0.05 * ref.abs().max().item(), err
        assert torch.corrcoef(torch.stack([row, ref]))[0, 1] > 0.999


# --- loader -----------------------------------------------------------------------------------


def _load(model_dir, dtype=torch.float32, pack=False):
    # Unpacked by default: these tests inspect the loaded weights themselves.
    return load_model(
        model_dir,
        torch.device("cpu"),
        dtype,
        select_kernel_ops("torch", "cpu"),
        pack_linear_weights=pack,
    )


def test_packed_projections_compute_what_the_checkpoint_weights_do(checkpoint):
    """On CPU the loader swaps every projection for a oneDNN-packed one; outputs stay the same."""
    from backend_lib.linear import PackedLinear

    model_dir, _ = checkpoint("Qwen2ForCausalLM")  # q/k/v biases too
    plain, packed = _load(model_dir), _load(model_dir, pack=True)
    pairs = [
        (name, module, packed.get_submodule(name))
        for name, module in plain.named_modules()
        if isinstance(module, torch.nn.Linear)
    ]
    assert pairs and all(isinstance(p, PackedLinear) for _, _, p in pairs)
    for name, linear, packed_linear in pairs:
        x_in = torch.randn(3, 5, linear.in_features)
        torch.testing.assert_close(
            packed_linear(x_in), linear(x_in), rtol=1e-5, atol=1e-5, msg=name
        )


def test_fused_weights_and_tied_head_come_from_checkpoint(checkpoint):
    model_dir, hf = checkpoint("Qwen2ForCausalLM")  # tied
    model = _load(model_dir)
    ref = hf.state_dict()
    attn = model.model.layers[1].self_attn
    torch.testing.assert_close(
        attn.qkv_proj.bias,
        torch.cat([ref[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"]),
        atol=0,
        rtol=0,
    )
    torch.testing.assert_close(
        model.model.layers[0].mlp.gate_up_proj.weight,
        torch.cat([ref[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")]),
        atol=0,
        rtol=0,
    )
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    untied_dir, untied_hf = checkpoint("LlamaForCausalLM")
    untied = _load(untied_dir)
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(untied.lm_head.weight, untied_hf.lm_head.weight, atol=0, rtol=0)


def test_sharded_checkpoint_loads_like_single_file(tmp_path, checkpoint):
    single_dir, _ = checkpoint("Qwen3ForCausalLM")
    build_checkpoint("Qwen3ForCausalLM", tmp_path, max_shard_size="50KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    single, sharded = _load(single_dir), _load(tmp_path)
    for (name, a), (_, b) in zip(
        single.named_parameters(), sharded.named_parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


def test_unsupported_architecture_lists_supported(tmp_path, checkpoint):
    model_dir, _ = checkpoint("LlamaForCausalLM")
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        _load(tmp_path)
    assert "GPT2LMHeadModel" in str(err.value)
    for arch in supported_architectures():
        assert arch in str(err.value)


def test_pickle_checkpoint_refused(tmp_path, checkpoint):
    model_dir, _ = checkpoint("LlamaForCausalLM")
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ConfigError, match="safetensors"):
        _load(tmp_path)


def test_missing_tensor_is_named(tmp_path, checkpoint):
    model_dir, _ = checkpoint("LlamaForCausalLM")
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        _load(tmp_path)
