"""The LLM-engine benchmarks (engine, batching_spread, prefix_cache, kv_memory, preemption, qos) in
the quick suite: their output checks passed, and their figures agree with what the workload implies."""

from __future__ import annotations

import math

import pytest

from bench.kv_memory import PRESETS as KV_PRESETS
from bench.kv_memory import sequence_lengths
from tests.bench.checks import quick_result

pytestmark = pytest.mark.bench


def test_engine(quick_suite):
    """Every system gives the engine's greedy tokens, and plain generate's."""
    result = quick_result(
        quick_suite,
        "engine",
        {
            "engine_vs_hf_static",
            "engine_vs_hf_generate_batch",
            "forward_time_share",
            "engine_int8_vs_float32",
        },
        plots=1,
        benchmark="llm_engine",
    )
    systems = {"engine", "hf_static", "hf_continuous"}
    assert set(result["output_tokens_per_second"]) == systems
    assert all(rate > 0 for rate in result["output_tokens_per_second"].values())
    for name in systems:
        assert result["fidelity_vs_generate"][name]["requests"] == 1.0
    assert all(a["requests"] == 1.0 for a in result["agreement_with_engine"].values())
    assert 0 < result["model_forward_share"] <= 1
    # The int8 engine: timed alongside, its greedy agreement reported (not required identical).
    int8 = result["int8"]
    assert int8["output_tokens_per_second"] > 0 and int8["ratio_vs_float_engine"] > 0
    assert 0 <= int8["agreement_with_float_engine"]["tokens"] <= 1


def test_batching_spread(quick_suite):
    result = quick_result(
        quick_suite, "batching_spread", {"continuous_vs_static_at_max_spread"}, plots=1
    )
    w = result["workload"]
    for run in result["runs"]:
        lens, s = run["output_lens"], run["spread"]
        assert len(lens) == w["requests"] and run["useful_tokens"] == sum(lens)
        assert all(
            round(w["mean_output"] * (1 - s)) <= n <= round(w["mean_output"] * (1 + s))
            for n in lens
        )
        batches = [lens[i : i + w["batch_size"]] for i in range(0, len(lens), w["batch_size"])]
        slots = sum(len(b) * max(b) for b in batches)
        assert run["static_useful_share"] == pytest.approx(sum(lens) / slots)
        assert set(run["tokens_per_second"]) == {"continuous", "static_engine", "hf_static"}
        # Each static batch is one prefill step plus decodes up to its longest output; the
        # continuous engine never needs more steps.
        assert run["engine_steps"]["static_engine"] == sum(max(b) for b in batches)
        assert run["engine_steps"]["continuous"] <= run["engine_steps"]["static_engine"]
        assert all(len(v) == result["repeats"] for v in run["seconds"].values())
    assert result["runs"][0]["static_useful_share"] == 1.0  # spread 0: equal lengths
    assert result["runs"][-1]["static_useful_share"] < 1.0
    assert all(f["exact_required"] for f in result["fidelity"].values())


def test_prefix_cache(quick_suite):
    result = quick_result(quick_suite, "prefix_cache", {"prefix_cache_ttft_reduction"}, plots=1)
    w = result["workload"]
    # Hits are whole blocks of the shared prefix (16-token blocks), over every prompt token.
    expected = (w["prefix_len"] // 16 * 16) / (w["prefix_len"] + w["suffix_len"])
    assert result["hit_rate"]["cache_on"] == [pytest.approx(expected)] * result["repeats"]
    assert result["hit_rate"]["cache_off"] == [0.0] * result["repeats"]
    for mode in ("cache_on", "cache_off"):
        assert len(result["ttft_seconds"][mode]) == w["requests"] * result["repeats"]
        assert 0 < result["ttft_ms"][mode]["p50"] <= result["ttft_ms"][mode]["p99"]


def test_kv_memory(quick_suite):
    result = quick_result(
        quick_suite,
        "kv_memory",
        {"kv_slot_utilization", "concurrency_gain_vs_preallocation"},
        plots=2,
    )
    settings, peak = result["settings"], result["utilization"]["peak"]
    assert 0 < peak["tokens"] <= peak["slots"] <= settings["pool_tokens"]
    assert result["summary"]["kv_slot_utilization"] == pytest.approx(peak["tokens"] / peak["slots"])
    # Independent block arithmetic over the same lengths: leading sequences whose blocks fit.
    lengths = sequence_lengths(KV_PRESETS["quick"], result["workload"]["seed"])
    blocks = [math.ceil(n / settings["block_size"]) for n in lengths]
    fit = max(k for k in range(len(blocks) + 1) if sum(blocks[:k]) <= settings["num_blocks"])
    assert fit < len(lengths), "the quick workload must overflow the pool"
    for max_len, c in result["concurrency"].items():
        assert c["paged"] == fit
        assert c["contiguous"] == settings["pool_tokens"] // int(max_len)
    series = result["utilization"]["series"]
    assert max(s["slots"] for s in series) == peak["slots"]


def test_preemption(quick_suite):
    result = quick_result(quick_suite, "preemption", {"swap_vs_recompute_throughput"}, plots=1)
    assert set(result["preemptions"]["baseline"]) == {0}
    assert min(result["preemptions"]["recompute"]) > 0 and min(result["preemptions"]["swap"]) > 0
    engines = result["settings"]["engines"]
    assert engines["recompute"]["num_blocks"] < engines["baseline"]["num_blocks"]
    rates = result["output_tokens_per_second"]
    assert all(0 < r["min"] <= r["median"] <= r["max"] for r in rates.values())


def test_qos(quick_suite):
    """Every mode ran the same traffic to the same greedy tokens; each interactive request has a
    TTFT, the flood a rate; the embedding half's vectors agreed in every mode."""
    from bench.qos import KEYS, MODES, THROUGHPUT_KEYS
    from bench.qos_embedding import FCFS_KEY, KEY

    keys = {*KEYS.values(), *(key for key, _ in THROUGHPUT_KEYS.values()), KEY, FCFS_KEY}
    result = quick_result(quick_suite, "qos", keys, plots=1)
    llm = result["llm"]
    assert set(llm["ttft_ms"]) == set(MODES)
    for mode in MODES:
        assert 0 < llm["ttft_ms"][mode]["p50"] <= llm["ttft_ms"][mode]["p99"]
        assert 0 <= llm["queue_wait_ms"][mode]["p50"] <= llm["ttft_ms"][mode]["p50"]
    assert set(llm["batch_output_tokens_per_second"]) == set(MODES) - {"alone"}
    for checks in result["fidelity"].values():
        assert set(checks) == set(MODES) - {"fcfs"}
        assert all(c["passed"] and c["exact_required"] for c in checks.values())
    embedding = result["embedding"]
    assert embedding["fidelity"]["passed"] and embedding["fidelity"]["min_cosine"] >= 0.99999
    assert set(embedding["latency_ms"]) == {"alone", "fcfs", "priority"}
    assert all(value > 0 for value in result["summary"].values())


def test_moe_engine(quick_suite):
    """The MoE engine's greedy tokens are plain generate's; transformers ran its fastest experts
    implementation of the ones it has."""
    result = quick_result(quick_suite, "moe_engine", {"engine_moe_vs_hf_static"}, plots=1)
    assert result["fidelity_vs_generate"]["engine"]["requests"] == 1.0
    assert result["model"]["architecture"] == "Qwen3MoeForCausalLM"
    settings = result["settings"]
    assert settings["hf_experts_implementation"] in settings["hf_experts_check_seconds"]
    assert all(rate > 0 for rate in result["output_tokens_per_second"].values())


def test_kv_offload(quick_suite):
    """Both modes ran the same agents to the same greedy tokens; the tier read history back (more
    cached tokens with it than without), and every request's reported cached tokens equal the
    prompt tokens the runner skipped."""
    keys = {"kv_offload_ttft_p50_ratio", "kv_offload_throughput_ratio"}
    result = quick_result(quick_suite, "kv_offload", keys, plots=0, against_target=True)
    w = result["workload"]
    assert w["working_set_blocks"] >= 2 * w["pool_blocks"]
    assert result["cached_equals_skipped"] is True
    assert min(result["tier_hit_tokens"]) > 0
    cached = result["cached_tokens"]
    assert min(cached["tier_on"]) > max(cached["tier_off"])
    requests = w["conversations"] * w["turns"]
    for mode in ("tier_off", "tier_on"):
        assert len(result["ttft_seconds"][mode]) == requests * result["repeats"]
    assert all(f["passed"] and f["exact_required"] for f in result["fidelity"].values())


def test_kv_routing(quick_suite):
    """Both policies served the same conversations to the same greedy tokens; each request has
    a TTFT and each policy a hit ratio."""
    keys = {"kv_routing_ttft_p50_ratio", "kv_routing_hit_ratio", "kv_routing_round_robin_hit_ratio"}
    result = quick_result(quick_suite, "kv_routing", keys, plots=0)
    w = result["workload"]
    requests = w["agents"] * w["conversations_per_agent"] * w["turns"]
    for policy in ("round_robin", "longest_prefix"):
        assert len(result["ttft_seconds"][policy]) == requests * result["repeats"]
        assert 0 <= result["hit_ratio"][policy] <= 1
    assert all(f["passed"] and f["exact_required"] for f in result["fidelity"].values())


def test_multimodal(quick_suite):
    """The engine's tokens equal transformers' generate for every image request before timing;
    repeated pictures hit the encoder cache (8 distinct pictures over 21 images); CLIP vectors
    equal transformers'."""
    keys = {"vlm_vs_hf_generate", "encoder_cache_hit_rate", "clip_image_embedding_vs_transformers"}
    result = quick_result(quick_suite, "multimodal", keys, plots=0, against_target=True)
    fidelity = result["fidelity"]
    assert fidelity["exact_required"] and fidelity["agreement"]["engine"]["requests"] == 1.0
    w = result["workload"]
    # Each picture encoded once; a picture split over prefill chunks counts a hit per later chunk.
    assert 1 - w["pictures"] / w["images"] <= result["encoder_cache_hit_rate"] < 1
    assert result["clip"]["min_cosine_float32"] >= 0.99999
    assert all(rate > 0 for rate in result["clip"]["images_per_second"].values())
