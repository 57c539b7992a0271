"""ModelRunner: KV pool block moves, their order in a step, parallel samples, logprobs, sizing."""

from __future__ import annotations

import math

import pytest
import torch

from backend_lib.config import ConfigError
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.core.scheduler import Scheduler
from backend_lib.llm.core.sequence import Sequence
from backend_lib.llm.execution.kv_pool import GIB, KVCacheSpec, KVPool, gpu_kv_cache_bytes
from backend_lib.llm.execution.loader import read_checkpoint_info
from backend_lib.llm.execution.model_runner import resolve_max_model_len
from tests.llm.config_helpers import BLOCK_SIZE
from tooling.hf_reference import hf_greedy, hf_next_logits

SPEC = KVCacheSpec(
    num_layers=3, num_kv_heads=2, head_dim=4, block_size=BLOCK_SIZE, dtype=torch.float32
)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _random_pool(num_blocks=10, num_host_blocks=4) -> KVPool:
    pool = KVPool(SPEC, num_blocks, num_host_blocks, torch.device("cpu"))
    torch.manual_seed(0)
    pool.device_cache.copy_(torch.randn_like(pool.device_cache))
    return pool


def test_swap_out_then_in_restores_kv_of_every_layer():
    pool = _random_pool()
    before = pool.device_cache.clone()
    pool.swap_out([(3, 0), (5, 2)])
    pool.device_cache.normal_()  # the freed device blocks get reused by others
    pool.swap_in([(0, 7), (2, 1)])
    torch.testing.assert_close(pool.device_cache[:, :, 7], before[:, :, 3], atol=0, rtol=0)
    torch.testing.assert_close(pool.device_cache[:, :, 1], before[:, :, 5], atol=0, rtol=0)
    # layer_caches are views of the same storage, per layer (K, V).
    k_cache, v_cache = pool.layer_caches[2]
    torch.testing.assert_close(v_cache[7], before[2, 1, 3], atol=0, rtol=0)
    assert k_cache.is_contiguous() and k_cache.shape == (10, BLOCK_SIZE, 2, 4)


def test_copy_blocks_copies_every_layer_and_nothing_else():
    pool = _random_pool()
    before = pool.device_cache.clone()
    pool.copy_blocks([(1, 4), (2, 6)])
    expected = before.clone()
    expected[:, :, 4], expected[:, :, 6] = before[:, :, 1], before[:, :, 2]
    torch.testing.assert_close(pool.device_cache, expected, atol=0, rtol=0)


def test_step_swaps_in_before_forward_and_logprobs_match_hf(checkpoint, session):
    model_dir, hf = checkpoint("Qwen3ForCausalLM")
    s = session(model_dir, preemption_mode="swap", swap_space=0.001)
    assert s.runner.num_host_blocks > 3
    seq = s.add(_prompt(20, 1), logprobs=3)
    s.step([(seq, None)])
    old_blocks = list(seq.block_table)
    # Preempt by swap: only block moves this step.
    assert s.step([], blocks_to_swap_out=[(b, h) for h, b in enumerate(old_blocks)]).sampled == {}
    s.runner.kv_pool.device_cache[:, :, old_blocks] = 1e3  # the blocks get reused meanwhile
    seq.block_table = [s.take_block() for _ in old_blocks]
    out = s.step([(seq, 1)], blocks_to_swap_in=[(h, b) for h, b in enumerate(seq.block_table)])
    context = seq.token_ids[:-1]
    ref = torch.log_softmax(hf_next_logits(hf, context), -1)
    (lp,) = out.logprobs[seq.seq_id]
    assert out.sampled[seq.seq_id] == [int(ref.argmax())] == [lp.token_id]
    assert math.isclose(lp.logprob, ref.max().item(), abs_tol=1e-4)
    assert lp.top_token_ids == ref.topk(3).indices.tolist()
    torch.testing.assert_close(torch.tensor(lp.top_logprobs), ref.topk(3).values, atol=1e-4, rtol=0)


def test_step_copies_shared_block_before_forward(checkpoint, session):
    """A fork shares a partly filled block; the copy-on-write copy must precede the writes."""
    model_dir, hf = checkpoint("LlamaForCausalLM")
    s = session(model_dir)
    parent = s.add(_prompt(11, 2))
    s.logits([(parent, None)])
    child = s.add(parent.token_ids)
    child.block_table, child.num_computed_tokens = list(parent.block_table), 11
    parent.append_token(40)
    child.append_token(41)
    child.block_table[-1] = s.take_block()
    logits = s.logits(
        [(parent, 1), (child, 1)], blocks_to_copy=[(parent.block_table[-1], child.block_table[-1])]
    )
    for row, seq in zip(logits, (parent, child), strict=True):
        torch.testing.assert_close(row, hf_next_logits(hf, seq.token_ids), atol=1e-4, rtol=1e-4)


def test_num_samples_draws_k_tokens_from_one_row(checkpoint, session):
    model_dir, _ = checkpoint("MistralForCausalLM")
    prompt = _prompt(9, 3)

    def fork_tokens(**params) -> list[int]:
        s = session(model_dir)
        seq = s.add(prompt, **params)
        out = s.step([(seq, None)], num_samples={seq.seq_id: 8})
        return out.sampled[seq.seq_id]

    seeded = fork_tokens(temperature=1.5, seed=11)
    assert len(seeded) == 8 and len(set(seeded)) > 1  # independent draws, not one repeated
    assert fork_tokens(temperature=1.5, seed=11) == seeded
    greedy = fork_tokens(temperature=0.0)
    assert greedy == [greedy[0]] * 8


def test_max_model_len_defaults_to_checkpoint_limit(checkpoint, make_runner):
    model_dir, hf = checkpoint("LlamaForCausalLM")
    runner = make_runner(model_dir, max_model_len=0, num_blocks=hf.config.max_position_embeddings)
    assert runner.max_model_len == hf.config.max_position_embeddings
    assert resolve_max_model_len(40, 128) == 40
    with pytest.raises(ConfigError, match="max_model_len"):
        resolve_max_model_len(129, 128)


def test_checkpoint_info_reads_limits_and_eos_ids(checkpoint, tmp_path):
    model_dir, hf = checkpoint("LlamaForCausalLM")
    info = read_checkpoint_info(model_dir)
    assert info.max_position_embeddings == hf.config.max_position_embeddings
    assert info.eos_token_ids == (hf.config.eos_token_id,)
    assert info.weight_files == (model_dir / "model.safetensors",)
    # generation_config.json's eos_token_id (an int or a list) wins over config.json's.
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).symlink_to(model_dir / name)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 9]}')
    assert read_checkpoint_info(tmp_path).eos_token_ids == (7, 9)


def test_cpu_pool_sized_from_memory_settings(checkpoint, make_runner):
    model_dir, hf = checkpoint("Qwen3ForCausalLM")
    cfg = hf.config
    block_bytes = (
        2 * cfg.num_hidden_layers * BLOCK_SIZE * cfg.num_key_value_heads * cfg.head_dim * 4
    )
    runner = make_runner(
        model_dir, num_blocks=0, cpu_kv_cache_gb=0.01, preemption_mode="swap", swap_space=0.002
    )
    assert runner.num_blocks == int(0.01 * GIB) // block_bytes
    assert runner.num_host_blocks == int(0.002 * GIB) // block_bytes
    assert runner.kv_pool.device_cache.shape[2] == runner.num_blocks
    assert make_runner(model_dir, num_blocks=40).num_blocks == 40
    assert (
        make_runner(model_dir, num_blocks=40).num_host_blocks == 0
    )  # recompute mode: no host pool
    with pytest.raises(ConfigError, match="max_model_len"):
        make_runner(
            model_dir, num_blocks=0, cpu_kv_cache_gb=block_bytes * 3 / GIB, max_model_len=32
        )


def test_gpu_budget_subtracts_everything_but_the_cache():
    total, weights, peak, other = 80 * GIB, 16 * GIB, 3 * GIB, 1 * GIB
    assert gpu_kv_cache_bytes(total, 0.9, weights, peak, other) == int(72 * GIB) - 20 * GIB


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_steps_from_the_real_scheduler_reproduce_generate(checkpoint, make_runner, preemption_mode):
    """Scheduler + runner on a pool too small for all requests: chunked prefill, prefix-cache
    hits and preemptions must leave every greedy output equal to `generate`."""
    model_dir, hf = checkpoint("Qwen2ForCausalLM")
    runner = make_runner(
        model_dir,
        num_blocks=10,
        max_model_len=40,
        max_num_batched_tokens=16,
        preemption_mode=preemption_mode,
        swap_space=0.001,
    )
    scheduler = Scheduler(
        runner.config, runner.num_blocks, runner.num_host_blocks, runner.max_model_len
    )
    shared = _prompt(BLOCK_SIZE * 2, 20)
    prompts = [shared + _prompt(3, 21), _prompt(13, 22), shared + _prompt(6, 23), _prompt(7, 24)]
    num_new = 8
    seqs = [
        Sequence(
            i,
            f"req-{i}",
            list(p),
            len(p),
            SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True),
            0.0,
        )
        for i, p in enumerate(prompts)
    ]
    for seq in seqs:
        scheduler.add(seq)
    for _ in range(200):
        if not scheduler.has_unfinished():
            break
        step = scheduler.schedule()
        scheduler.update(step, runner.execute(step).sampled)
    stats = scheduler.stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.token_ids[len(prompt) :] == hf_greedy(hf, prompt, num_new), seq.seq_id


def test_batch_rows_put_decodes_first_longest_first_and_logits_keep_scheduled_order(
    checkpoint, session
):
    # The CPU attention relies on the layout (similar-length decodes in consecutive rows); the
    # engine relies on logits rows in scheduled order.
    model_dir, hf = checkpoint("LlamaForCausalLM")
    s = session(model_dir)
    short, long, mid, late = (s.add(_prompt(n, seed=n)) for n in (3, 21, 9, 6))
    s.logits([(short, None), (long, None), (mid, None)])
    for q in (short, long, mid):
        q.append_token(5)
    plan = s.plan([(late, None), (short, 1), (long, 1), (mid, 1)])
    batch = s.runner.prepare_input(plan.scheduled)
    assert batch.meta.seq_lens.tolist() == [22, 10, 4, 6]  # long, mid, short decodes; late chunk
    assert batch.meta.query_start_loc.tolist() == [0, 1, 2, 3, 9]
    assert batch.sample_seq_ids == [late.seq_id, short.seq_id, long.seq_id, mid.seq_id]
    assert batch.sample_indices.tolist() == [8, 2, 0, 1]
    logits = s.runner.compute_logits(batch)
    for row, q in zip(logits, (late, short, long, mid), strict=True):
        torch.testing.assert_close(row, hf_next_logits(hf, q.token_ids), atol=1e-4, rtol=1e-4)
