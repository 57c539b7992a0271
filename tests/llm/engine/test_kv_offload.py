"""The prefix cache's offload tier through the engine: with a pool too small to keep the
conversations' prefixes, the tier reads them back instead of recomputing them, and greedy output
stays equal to transformers (and to the engine without a tier) from RAM, from disk, from both,
for float32, bfloat16 and int8 caches, under chunked prefill and LoRA, after a restart that
reuses the disk tier, and through the disk faults (a flipped byte, a truncated file, a full disk,
a path turned read-only), which cost recomputation and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from backend_lib.config import ConfigError
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.engine.llm_engine import LLMEngine
from backend_lib.llm.execution.kv_tier_files import HEADER, SUFFIX
from backend_lib.llm.kv_offload_config import GIB
from tests.llm.config_helpers import llm_config
from tests.llm.engine_helpers import (
    assert_pool_released,
    engine_checkpoint,
    greedy,
    make_engine,
    random_prompt,
)
from tests.llm.lora_helpers import lora_checkpoint, make_lora_engine
from tooling.hf_reference import hf_greedy

pytestmark = pytest.mark.usefixtures("single_torch_thread")

ARCH = "Qwen2ForCausalLM"
POOL = dict(num_blocks=12, max_model_len=64, max_num_batched_tokens=64)
"""12 blocks of 8: two conversations at a time, never the six prefixes of a round."""
NUM_TOKENS = 4


def conversations(seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Six conversations (36 tokens each, no prefix shared between them) and their next turns."""
    first = [random_prompt(36, 100 + seed + i) for i in range(6)]
    second = [turn + random_prompt(5, 200 + seed + i) for i, turn in enumerate(first)]
    return first, second


def tier_settings(tier: str, path: Path, ram_blocks: int = 64, block_bytes: int = 0) -> dict:
    """LLMConfig settings of a RAM, disk or RAM-then-disk tier (`ram_blocks` of `block_bytes`)."""
    ram = {"kv_offloading_size": ram_blocks * block_bytes / GIB}
    disk = {"kv_offloading_path": str(path), "kv_offloading_disk_size": 0.01}
    return {"kv_offloading_backend": "native"} | {
        "ram": ram,
        "disk": disk,
        "both": {**disk, "kv_offloading_size": 8 * block_bytes / GIB},
    }[tier]


def block_bytes(model_dir: Path, **settings: Any) -> int:
    engine = make_engine(model_dir, **POOL, **settings)
    size = engine.runner.kv_spec.bytes_per_block
    engine.close()
    return size


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | None = None):
    return engine.generate(prompts, params or greedy(NUM_TOKENS))


@pytest.mark.parametrize("tier", ["ram", "disk", "both"])
def test_tier_reads_back_evicted_prefixes_exactly(tier, tmp_path):
    model_dir, hf = engine_checkpoint(ARCH)
    size = block_bytes(model_dir)
    engine = make_engine(model_dir, **POOL, **tier_settings(tier, tmp_path, block_bytes=size))
    first, second = conversations()
    computed = record_prompt_tokens_computed(engine)
    run(engine, first)
    if tier != "ram":
        engine.close()  # the disk tier's writes done; a second engine finds the files
        engine = make_engine(model_dir, **POOL, **tier_settings(tier, tmp_path, block_bytes=size))
        computed = record_prompt_tokens_computed(engine)
    computed.clear()
    outs = run(engine, second)

    for prompt, out in zip(second, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NUM_TOKENS)
    offloaded = [out.num_offloaded_cached_tokens for out in outs]
    assert sum(offloaded) >= 3 * 32, offloaded  # most prefixes came back from the tier
    stats = engine.stats()
    assert stats.kv_offload.external_hits == sum(offloaded)
    # Cached tokens as reported are exactly the prompt tokens the engine did not compute.
    skipped = sum(len(p) for p in second) - sum(computed.values())
    assert skipped == sum(out.num_cached_tokens for out in outs)
    tier_counts = stats.kv_offload.ram if tier == "ram" else stats.kv_offload.disk
    assert tier_counts.hits > 0 and tier_counts.errors == 0
    assert_pool_released(engine)
    engine.close()


def record_prompt_tokens_computed(engine: LLMEngine) -> dict[str, int]:
    """Request id -> prompt tokens the runner computed for it (filled as the engine steps)."""
    computed: dict[str, int] = {}
    execute = engine.runner.execute

    def counting(out, *args):
        for scheduled in out.scheduled:
            seq = scheduled.seq
            start = scheduled.start_position
            prompt_part = max(0, min(seq.num_prompt_tokens - start, scheduled.num_new_tokens))
            computed[seq.request_id] = computed.get(seq.request_id, 0) + prompt_part
        return execute(out, *args)

    engine.runner.execute = counting
    return computed


@pytest.mark.parametrize("settings", [dict(dtype="bfloat16"), dict(kv_cache_dtype="int8")])
def test_tier_keeps_outputs_of_bfloat16_and_int8_caches(settings, tmp_path):
    model_dir, _ = engine_checkpoint(ARCH)
    first, second = conversations(seed=7)
    plain = make_engine(model_dir, **POOL, **settings)
    run(plain, first)
    want = [out.outputs[0].token_ids for out in run(plain, second)]
    size = block_bytes(model_dir, **settings)
    engine = make_engine(
        model_dir, **POOL, **settings, **tier_settings("ram", tmp_path, block_bytes=size)
    )
    run(engine, first)
    outs = run(engine, second)
    assert [out.outputs[0].token_ids for out in outs] == want
    assert sum(out.num_offloaded_cached_tokens for out in outs) >= 3 * 32
    store = engine.runner.offload
    if settings.get("kv_cache_dtype") == "int8":  # stored as the pool holds it: int8 and scales
        assert store.values.dtype == torch.int8 and store.scales.abs().sum() > 0
    assert_pool_released(engine)


def test_tier_with_chunked_prefill_matches_transformers(tmp_path):
    model_dir, hf = engine_checkpoint(ARCH)
    size = block_bytes(model_dir)
    settings = POOL | dict(max_num_batched_tokens=16)
    engine = make_engine(model_dir, **settings, **tier_settings("ram", tmp_path, block_bytes=size))
    first, second = conversations(seed=3)
    run(engine, first)
    outs = run(engine, second)
    for prompt, out in zip(second, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NUM_TOKENS)
    assert sum(out.num_offloaded_cached_tokens for out in outs) > 0
    assert_pool_released(engine)


def test_lora_rows_keep_their_own_blocks_in_the_tier(tmp_path):
    model_dir, hf, adapters = lora_checkpoint("LlamaForCausalLM")
    modules = {name: path for name, (path, _) in adapters.items()}
    size = block_bytes(model_dir)
    engine = make_lora_engine(
        model_dir, modules, **POOL, **tier_settings("ram", tmp_path, block_bytes=size)
    )
    shared = random_prompt(36, 41)
    names = [None, "r4", "r16"]
    fillers = [random_prompt(36, 50 + i) for i in range(4)]
    engine.generate([shared] * 3, greedy(NUM_TOKENS), lora_names=names)
    engine.generate(fillers, greedy(NUM_TOKENS))  # evicts the three chains from the pool
    prompts = [shared + random_prompt(5, 60 + i) for i in range(3)]
    outs = engine.generate(prompts, greedy(NUM_TOKENS), lora_names=names)
    references = {None: hf} | {name: peft for name, (_, peft) in adapters.items()}
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(references[name], prompt, NUM_TOKENS)
        assert out.num_offloaded_cached_tokens == 32  # its own chain, not another adapter's
    assert_pool_released(engine)


def test_two_tensor_parallel_ranks_offload_their_own_shards(tmp_path):
    model_dir, hf = engine_checkpoint(ARCH)
    size = block_bytes(model_dir)  # the total over ranks: each rank keeps its half of a block
    engine = make_engine(
        model_dir,
        **POOL,
        tensor_parallel_size=2,
        **tier_settings("ram", tmp_path, block_bytes=size),
    )
    try:
        first, second = conversations(seed=23)
        run(engine, first)
        outs = run(engine, second)
        for prompt, out in zip(second, outs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NUM_TOKENS)
        assert sum(out.num_offloaded_cached_tokens for out in outs) >= 3 * 32
        assert_pool_released(engine)
    finally:
        engine.close()


# --- the disk tier across restarts and faults ------------------------------------------------


def disk_engine(model_dir: Path, path: Path, **settings: Any) -> LLMEngine:
    return make_engine(model_dir, **POOL, **tier_settings("disk", path), **settings)


def first_round_on_disk(
    model_dir: Path, path: Path, prompts: list[list[int]], **settings: Any
) -> list[Path]:
    """Run `prompts` on a disk-tier engine and close it; rank 0's block files it left."""
    engine = disk_engine(model_dir, path, **settings)
    run(engine, prompts)
    engine.close()
    return sorted((path / "rank0").glob(f"*{SUFFIX}"))


def test_restart_reuses_the_disk_tier_only_for_the_same_layout(tmp_path):
    model_dir, hf = engine_checkpoint(ARCH)
    first, second = conversations(seed=11)
    files = first_round_on_disk(model_dir, tmp_path, first)
    assert len(files) >= 6 * 4

    engine = disk_engine(model_dir, tmp_path)
    assert engine.runner.offload.files.reused
    outs = run(engine, second[:3])
    for prompt, out in zip(second, outs, strict=False):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NUM_TOKENS)
        assert out.num_offloaded_cached_tokens == 32
    engine.close()

    other = disk_engine(model_dir, tmp_path, block_size=16)  # another layout: files not reused
    assert not other.runner.offload.files.reused
    assert not list((tmp_path / "rank0").glob(f"*{SUFFIX}"))
    other.close()


def test_two_ranks_keep_their_own_shards_on_disk_and_any_rank_s_bad_file_is_a_miss(tmp_path):
    """Each tensor-parallel rank writes its shard under the block's hash in its own directory;
    a block comes back only if every rank read its shard intact (rank 1's damaged files alone
    make those blocks misses, recomputed)."""
    model_dir, hf = engine_checkpoint(ARCH)
    first, second = conversations(seed=29)
    rank0 = [
        p.name for p in first_round_on_disk(model_dir, tmp_path, first, tensor_parallel_size=2)
    ]
    rank1 = sorted(p.name for p in (tmp_path / "rank1").glob(f"*{SUFFIX}"))
    assert rank0 == rank1 and len(rank0) >= 6 * 4
    damaged = sorted((tmp_path / "rank1").glob(f"*{SUFFIX}"))[::3]
    for file in damaged:
        data = bytearray(file.read_bytes())
        data[-1] ^= 0x01
        file.write_bytes(bytes(data))

    engine = disk_engine(model_dir, tmp_path, tensor_parallel_size=2)
    try:
        outs = run(engine, second)
        for prompt, out in zip(second, outs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NUM_TOKENS)
        stats = engine.stats().kv_offload
        assert stats.disk.hits > 0 and stats.disk.errors > 0
        assert sum(out.num_offloaded_cached_tokens for out in outs) > 0
        assert_pool_released(engine)
    finally:
        engine.close()


def test_corrupt_and_truncated_files_are_recomputed_never_served(tmp_path):
    model_dir, hf = engine_checkpoint(ARCH)
    first, second = conversations(seed=13)
    files = first_round_on_disk(model_dir, tmp_path, first)
    for index, file in enumerate(files):
        data = bytearray(file.read_bytes())
        if index % 2:
            data[HEADER.size + len(data) // 3] ^= 0x40  # one flipped bit in the K/V
            file.write_bytes(bytes(data))
        else:
            file.write_bytes(bytes(data[: len(data) - 5]))  # cut short

    engine = disk_engine(model_dir, tmp_path)
    outs = run(engine, second)
    for prompt, out in zip(second, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NUM_TOKENS)
        assert out.num_offloaded_cached_tokens == 0 and out.error is None
    stats = engine.stats().kv_offload
    assert stats.disk.errors > 0 and stats.disk.hits == 0
    # Each bad file read was dropped (a block recomputed and evicted again is written afresh).
    assert sum(map(is_damaged, files)) == len(files) - stats.disk.errors
    assert_pool_released(engine)
    engine.close()


def is_damaged(file: Path) -> bool:
    """Whether a block file is there and fails its length or checksum check."""
    if not file.exists():
        return False
    data = file.read_bytes()
    *_, length, crc = HEADER.unpack_from(data)
    return len(data) != HEADER.size + length or zlib.crc32(data[HEADER.size :]) != crc


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Any:
    """A tmpfs of `size` mounted at `path` (root only: CI runs as root)."""
    if os.geteuid() != 0:
        pytest.fail("mounting a small filesystem needs root (CI runs as root)")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_turns_the_disk_tier_off_and_serves_on(tmp_path):
    model_dir, hf = engine_checkpoint(ARCH)
    first, second = conversations(seed=17)
    with tmpfs(tmp_path / "quota", "48k") as path:
        engine = disk_engine(model_dir, path)
        run(engine, first)
        outs = run(engine, second)
        engine.step()  # reports the failed write
        for prompt, out in zip(second, outs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NUM_TOKENS)
            assert out.error is None
        offload = engine.scheduler.kv_cache_manager.offload
        assert not offload.disk_enabled
        assert engine.stats().kv_offload.disk.errors >= 1
        assert_pool_released(engine)
        engine.close()


def test_a_path_turned_read_only_turns_the_disk_tier_off(tmp_path):
    model_dir, hf = engine_checkpoint(ARCH)
    first, second = conversations(seed=19)
    with tmpfs(tmp_path / "ro", "16m") as path:
        engine = disk_engine(model_dir, path)
        subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        run(engine, first)
        outs = run(engine, second)
        for prompt, out in zip(second, outs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NUM_TOKENS)
        assert not engine.scheduler.kv_cache_manager.offload.disk_enabled
        assert engine.stats().kv_offload.disk.errors >= 1
        assert_pool_released(engine)
        engine.close()


# --- settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, field",
    [
        (dict(kv_offloading_backend="lmcache"), "kv_offloading_backend"),
        (dict(kv_offloading_backend="native", kv_offloading_size=-1.0), "kv_offloading_size"),
        (dict(kv_offloading_backend="native"), "kv_offloading_size"),
        (dict(kv_offloading_size=1.0), "kv_offloading_size"),
        (
            dict(kv_offloading_backend="native", kv_offloading_path="/x"),
            "kv_offloading_disk_size",
        ),
        (
            dict(
                kv_offloading_backend="native", kv_offloading_size=1.0, enable_prefix_caching=False
            ),
            "kv_offloading_backend",
        ),
    ],
)
def test_bad_settings_are_refused_naming_the_field(settings, field):
    with pytest.raises(ConfigError) as info:
        llm_config(Path("m"), **settings)
    assert info.value.key == field


def test_an_unwritable_path_is_refused_at_load(tmp_path):
    model_dir, _ = engine_checkpoint(ARCH)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = llm_config(model_dir, **POOL, **tier_settings("disk", blocker / "tier"))
    with pytest.raises(ConfigError) as info:
        LLMEngine(config, model_dir, torch.device("cpu"))
    assert info.value.key == "kv_offloading_path"
