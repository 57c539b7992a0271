"""kv_cache_dtype (int8, fp8): the setting's validation, the KV pool's 8-bit values plus scales (its
sizing and block moves), and the engine end to end: greedy generation over an int8 cache through
prefix-cache hits and swap preemption gives the tokens of the plain run. The perplexity gate is in
test_quantization_quality.py."""

from __future__ import annotations

import pytest
import torch

from backend_lib.config import ConfigError, from_parameters
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.execution.kv_pool import (
    KVCacheSpec,
    KVPool,
    blocks_in,
    resolve_kv_cache_dtype,
)
from tests.llm.config_helpers import BLOCK_SIZE
from tests.llm.engine_helpers import (
    assert_pool_released,
    engine_checkpoint,
    greedy,
    make_engine,
    output_ids,
    random_prompt,
)

pytestmark = pytest.mark.usefixtures("single_torch_thread")

KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _spec(dtype: torch.dtype) -> KVCacheSpec:
    return KVCacheSpec(
        num_layers=3, num_kv_heads=2, head_dim=64, block_size=BLOCK_SIZE, dtype=dtype
    )


def test_unknown_kv_cache_dtype_is_a_config_error_naming_it():
    assert from_parameters(LLMConfig, {"kv_cache_dtype": "int8"}).kv_cache_dtype == "int8"
    with pytest.raises(ConfigError, match="kv_cache_dtype") as error:
        from_parameters(LLMConfig, {"kv_cache_dtype": "int4"}).validate()
    assert "auto, int8, fp8" in str(error.value)
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        resolve_kv_cache_dtype("fp16", torch.float32, torch.device("cpu"))


def test_auto_is_the_model_dtype_and_8_bit_settings_their_storage():
    cpu = torch.device("cpu")
    assert LLMConfig().kv_cache_dtype == "auto"
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    for setting, dtype in KV_DTYPES.items():
        assert resolve_kv_cache_dtype(setting, torch.float32, cpu) == dtype


def test_block_sizing_counts_the_scales():
    # Row of head_dim 64: float32 256 bytes, bfloat16 128, 8-bit 64 + a 4-byte scale.
    rows = 2 * 3 * BLOCK_SIZE * 2
    assert _spec(torch.float32).bytes_per_block == rows * 256
    assert _spec(torch.bfloat16).bytes_per_block == rows * 128
    for dtype in KV_DTYPES.values():
        assert _spec(dtype).bytes_per_block == rows * 68
        budget = 1 << 24
        fp32, bf16 = (
            blocks_in(budget, _spec(torch.float32)),
            blocks_in(budget, _spec(torch.bfloat16)),
        )
        eight = blocks_in(budget, _spec(dtype))
        assert 3.7 < eight / fp32 < 3.8 and 1.85 < eight / bf16 < 1.9


def _random_pool(dtype: torch.dtype) -> KVPool:
    pool = KVPool(_spec(dtype), 10, 4, torch.device("cpu"))
    pool.device_cache.copy_(torch.randn(pool.device_cache.shape).mul(50).clamp(-127, 127).to(dtype))
    pool.device_scales.copy_(torch.rand_like(pool.device_scales))
    return pool


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("setting", list(KV_DTYPES))
def test_pool_layers_hold_values_and_scales_views(setting):
    pool = _random_pool(KV_DTYPES[setting])
    assert pool.device_scales.shape == (3, 2, 10, BLOCK_SIZE, 2)
    assert pool.host_scales.shape == (3, 2, 4, BLOCK_SIZE, 2)
    k_cache, v_cache, k_scale, v_scale = pool.layer_caches[1]
    assert k_cache.dtype == KV_DTYPES[setting] and k_cache.shape == (10, BLOCK_SIZE, 2, 64)
    assert k_scale.dtype == torch.float32 and k_scale.shape == (10, BLOCK_SIZE, 2)
    assert k_scale.data_ptr() == pool.device_scales[1, 0].data_ptr()
    assert v_scale.data_ptr() == pool.device_scales[1, 1].data_ptr()
    assert v_cache.data_ptr() == pool.device_cache[1, 1].data_ptr()


@pytest.mark.parametrize("setting", list(KV_DTYPES))
def test_swap_and_copy_move_the_scales_with_the_values(setting):
    pool = _random_pool(KV_DTYPES[setting])
    values, scales = _bytes(pool.device_cache).clone(), pool.device_scales.clone()
    pool.swap_out([(3, 0), (5, 2)])
    _bytes(pool.device_cache).random_(0, 100)
    pool.device_scales.normal_()
    pool.swap_in([(0, 7), (2, 1)])
    assert torch.equal(_bytes(pool.device_cache)[:, :, 7], values[:, :, 3])
    assert torch.equal(_bytes(pool.device_cache)[:, :, 1], values[:, :, 5])
    assert torch.equal(pool.device_scales[:, :, 7], scales[:, :, 3])
    assert torch.equal(pool.device_scales[:, :, 1], scales[:, :, 5])

    values, scales = _bytes(pool.device_cache).clone(), pool.device_scales.clone()
    pool.copy_blocks([(1, 4), (2, 6)])
    values[:, :, 4], values[:, :, 6] = values[:, :, 1].clone(), values[:, :, 2].clone()
    scales[:, :, 4], scales[:, :, 6] = scales[:, :, 1].clone(), scales[:, :, 2].clone()
    assert torch.equal(_bytes(pool.device_cache), values)
    assert torch.equal(pool.device_scales, scales)


def test_runner_sizes_an_int8_pool_from_the_same_memory():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    full = make_engine(model_dir, num_blocks=0, cpu_kv_cache_gb=0.01)
    int8 = make_engine(model_dir, num_blocks=0, cpu_kv_cache_gb=0.01, kv_cache_dtype="int8")
    pool = int8.runner.kv_pool
    assert pool.device_cache.dtype == torch.int8 and pool.device_scales is not None
    assert full.runner.kv_pool.device_scales is None
    head_dim = pool.spec.head_dim
    want = 4 * head_dim / (head_dim + 4)  # float32 rows vs int8 rows plus their scales
    assert int8.runner.num_blocks / full.runner.num_blocks == pytest.approx(want, rel=0.01)


@pytest.mark.parametrize("setting", list(KV_DTYPES))
def test_greedy_over_8_bit_cache_is_the_same_through_prefix_hits_and_swap(setting):
    """One plain run (no prefix caching, a pool that never fills) against a run whose second wave
    hits the prefix cache and a run that swaps sequences out and back in: the same tokens. The
    8-bit cache also stays close to the float32 engine (most tokens agree)."""
    model_dir, _ = engine_checkpoint("Qwen3ForCausalLM")
    shared = random_prompt(20, 3)
    prompts = [shared + random_prompt(n, 10 + n) for n in (5, 2, 9)]
    prompts += [random_prompt(n, 30 + n) for n in (19, 13, 7)]
    params = greedy(10)

    plain = make_engine(model_dir, kv_cache_dtype=setting, enable_prefix_caching=False)
    want = output_ids(plain, prompts, params)

    cached = make_engine(model_dir, kv_cache_dtype=setting)
    output_ids(cached, prompts[:1], params)  # fills the cache with the shared prefix
    hits = cached.stats().counters.prefix_cache_hits
    assert output_ids(cached, prompts, params) == want
    assert cached.stats().counters.prefix_cache_hits > hits
    assert_pool_released(cached)

    swapped = make_engine(
        model_dir,
        kv_cache_dtype=setting,
        enable_prefix_caching=False,
        num_blocks=10,
        max_model_len=40,
        max_num_batched_tokens=16,
        preemption_mode="swap",
        swap_space=0.001,
    )
    pool, swaps = swapped.runner.kv_pool, []
    swap_in = pool.swap_in
    pool.swap_in = lambda pairs: (swaps.extend(pairs), swap_in(pairs))
    assert output_ids(swapped, prompts, params) == want
    assert swapped.stats().counters.num_preemptions > 0 and swaps  # blocks came back from host
    assert_pool_released(swapped)

    full = output_ids(make_engine(model_dir), prompts, params)
    agree = sum(a == b for x, y in zip(want, full, strict=True) for a, b in zip(x, y, strict=True))
    assert agree >= 0.8 * sum(map(len, full)), (agree, want, full)
