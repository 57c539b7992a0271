"""The real-size benchmark: its quick run in the suite (the engine alone on a tiny model, the peers
skipped with why), the weight bytes it counts per token, how its summary figures are chosen, the
per-request latencies the peers' worker measures, and llama.cpp's build options."""

from __future__ import annotations

import itertools

import pytest
import torch
from safetensors import safe_open

from bench import real_sizes
from bench.peers import env, worker
from tests.bench.checks import check_report, load_result

pytestmark = pytest.mark.bench


def test_quick_run_times_the_engine_alone_and_counts_its_bytes(quick_suite):
    result = load_result(quick_suite, "real_sizes")
    assert result["quick"] is True and result["peers"]["run"] is False
    [record] = result["runs"]
    assert (record["threads"], record["precision"], record["dtype"]) == (1, "f32", "float32")
    assert [t["requests"] for t in record["concurrency"]] == [1, 4]
    for timed in record["concurrency"]:
        assert set(timed["seconds"]) == {"engine"}
        assert timed["ttft_ms"]["engine"]["p50"] > 0 and timed["tpot_ms"]["engine"]["p50"] > 0
    assert all("--quick" in why for why in record["excluded"].values())
    fraction = record["bandwidth_fraction"]["engine"]
    assert result["summary"] == {"c1_bandwidth_fraction_f32": fraction} and fraction > 0
    assert set(result["missing"]) == {t.key for t in _targets()} - {"c1_bandwidth_fraction_f32"}
    assert all("--quick" in why for why in result["missing"].values())
    [small] = result["small_model"]["runs"]
    assert small["concurrency"][0]["decode_tokens_per_second"]["engine"] > 0
    check_report("real_sizes", result)


def _targets():
    from bench.summary import TARGETS

    prefixes = (*real_sizes.KEYS, real_sizes.SMALL_KEY)
    return [t for t in TARGETS if t.key.startswith(prefixes)]


def test_weight_bytes_per_token_are_the_weights_but_the_embedding(tmp_path):
    from bench.llm import new_engine
    from tooling.checkpoints import Sizes, build_random_llama

    build_random_llama(Sizes(**real_sizes.QUICK_SHAPE), tmp_path, byte_level_tokenizer=True)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        sizes = {name: f.get_slice(name).get_shape() for name in f.keys()}  # noqa: SIM118
    quantized_layers = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    quantized_layers += ("lm_head",)  # quantization: int8 covers the head too

    def held(name, shape, quantized):
        values = torch.Size(shape).numel()
        if quantized and name.split(".")[-2] in quantized_layers:
            return values + 4 * shape[0]  # int8 values, a float32 scale per output row
        return 4 * values

    for quantization in ("none", "int8"):
        expected = sum(
            held(name, shape, quantization == "int8")
            for name, shape in sizes.items()
            if name != "model.embed_tokens.weight"
        )
        engine = new_engine(tmp_path, torch.device("cpu"), "float32", quantization=quantization)
        assert real_sizes.weight_bytes_per_token(engine.runner.model) == expected


def _record(threads, precision, ours, theirs, fraction=0.8, peer="openvino_genai"):
    timed = {
        "requests": 1,
        "decode_tokens_per_second": {"engine": ours, peer: theirs},
        "output_tokens_per_second": {},
    }
    return {
        "threads": threads,
        "precision": precision,
        "concurrency": [timed],
        "bandwidth_fraction": {"engine": fraction},
        "excluded": {},
    }


def test_a_summary_figure_is_the_worse_thread_count_and_a_gap_says_why():
    runs = [
        _record(1, "f32", 6.0, 5.0, fraction=0.9),
        _record(2, "f32", 9.0, 10.0, fraction=0.8),
        _record(1, "bf16", 10.0, 8.0),
    ]
    runs[2]["excluded"] = {"llama_cpp": "failed: boom"}
    summary, missing = real_sizes.summarize(runs, [], {"int4": "not asked"}, None)
    assert summary["c1_bandwidth_fraction_f32"] == pytest.approx(0.8)
    assert summary["c1_decode_vs_openvino_genai_f32"] == pytest.approx(0.9)
    assert summary["c1_decode_vs_openvino_genai_bf16"] == pytest.approx(1.25)
    assert missing["c1_decode_vs_llama_cpp_bf16"] == "failed: boom"
    assert missing["c1_bandwidth_fraction_int4"] == "not asked"
    assert missing["c16_throughput_vs_openvino_genai_bf16"] == "concurrency 16 not run"


def test_the_stream_clock_gives_each_requests_ttft_and_tpot(monkeypatch):
    ticks = itertools.chain([100.0], [100.5, 100.7, 101.1, 101.5])
    monkeypatch.setattr(worker.time, "perf_counter", lambda: next(ticks))
    clock = worker.StreamClock(2)
    clock.tokens(0, 1)  # 0.5 s after the start
    clock.tokens(1, 2)  # two tokens at once
    clock.tokens(0, 2)
    clock.tokens(0, 3)
    first, second = clock.latencies()
    assert first == {"ttft": pytest.approx(0.5), "tpot": pytest.approx(0.5), "tokens": 3}
    assert second == {"ttft": pytest.approx(0.7), "tpot": 0.0, "tokens": 2}


def test_llama_cpp_builds_for_this_cpus_instruction_sets_without_amx(monkeypatch):
    flags = ["sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "amx_tile", "amx_int8"]
    monkeypatch.setattr(env, "cpu_flags", lambda: flags)
    options = dict(o.removeprefix("-D").split("=") for o in env.llama_cpp_cmake_args().split())
    assert options["GGML_NATIVE"] == "OFF" and options["GGML_AVX512"] == "ON"
    assert options["GGML_AVX2"] == "ON" and options["GGML_AVX512_BF16"] == "OFF"
    assert not any("AMX" in name for name in options)
    wide = env.cpu_features_hash()
    monkeypatch.setattr(env, "cpu_flags", lambda: ["avx", "avx2", "fma"])
    assert "-DGGML_AVX512=OFF" in env.llama_cpp_cmake_args()
    assert env.cpu_features_hash() != wide  # another CPU: another cached wheel


def test_an_unknown_precision_is_refused_naming_it():
    import argparse

    args = argparse.Namespace(quick=False, precisions=["f32", "fp4"])
    with pytest.raises(SystemExit, match=r"--precisions: unknown \['fp4'\]"):
        real_sizes.chosen_precisions(args)
