"""engine_peers' side-by-side of where the time goes (bench.peers.time_split): the weight shapes
are the model's, the profiler split adds up and puts GEMMs and elementwise work where they
belong, and the peer's estimate follows the measured rates (made-up rates, nothing timed)."""

from __future__ import annotations

import functools

import pytest
import torch

from bench.peers import time_split

pytestmark = pytest.mark.bench


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The splits compare op times: with a second OpenMP thread, a loaded machine (make test runs
    two workers beside servers) makes small ops wait for a time slice, and the shares swing
    (seen: the elementwise ops of 10 ms of int8 GEMMs taking 1.2 s)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_weight_shapes_are_the_models_linears(tmp_path):
    from transformers import AutoModelForCausalLM

    from tooling.checkpoints import QUICK, build_random_llama

    build_random_llama(QUICK, tmp_path, seed=0)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    layer = model.model.layers[0]
    attention, mlp = layer.self_attn, layer.mlp
    # (in, out) of nn.Linear = weight.shape reversed; qkv and gate_up are fused in our engine.
    expected = {
        "qkv_proj": (
            attention.q_proj.in_features,
            sum(p.out_features for p in (attention.q_proj, attention.k_proj, attention.v_proj)),
        ),
        "o_proj": (attention.o_proj.in_features, attention.o_proj.out_features),
        "gate_up_proj": (mlp.gate_proj.in_features, 2 * mlp.gate_proj.out_features),
        "down_proj": (mlp.down_proj.in_features, mlp.down_proj.out_features),
        "lm_head": (model.lm_head.in_features, model.lm_head.out_features),
    }
    assert time_split.weight_shapes(QUICK) == expected


def _gemms():
    a = torch.randn(256, 256)
    for _ in range(40):
        a = torch.mm(a, a) / 16


@functools.cache
def _int8_linear():
    from backend_lib.quantization import QuantizedLinear

    return QuantizedLinear.from_linear(torch.nn.Linear(512, 512), "int8")


def _int8_gemms():
    linear, x = _int8_linear(), torch.randn(256, 512)
    with torch.inference_mode():
        for _ in range(40):
            linear(x)


def _elementwise():
    a = torch.randn(512, 512)
    for _ in range(400):
        a = (a * 0.5).sin()


@pytest.mark.parametrize("work, dominant", [(_gemms, "gemm"), (_elementwise, "other_ops")])
def test_engine_split_adds_up_and_puts_work_where_it_belongs(work, dominant):
    split = time_split.engine_split(work)
    assert sum(split[p] for p in time_split.KINDS) == pytest.approx(split["wall"], rel=1e-6)
    # Of the ops' own time: the profiler's start-up lands in outside_ops, and on a loaded
    # machine it took over half of a 40-GEMM run.
    ops = split["gemm"] + split["attention"] + split["other_ops"]
    assert split[dominant] > 0.5 * ops
    assert split["attention"] == 0.0
    assert split["wall"] == split["profiled_wall"]


def test_int8_linears_count_as_gemms():
    _int8_gemms()  # warm-up: fbgemm's packing is not the split's
    split = time_split.engine_split(_int8_gemms)
    # The ops' own times only: the profiler's start-up lands in outside_ops, and on a loaded
    # machine it outweighs these ~10 ms of work.
    assert split["gemm"] > split["other_ops"] > 0


def test_engine_split_scales_its_shares_to_an_unprofiled_runs_time():
    # One profiled run, scaled: two runs' shares differ on a loaded machine (the profiler's
    # start-up, in outside_ops, took 0.8 of one run in CI and 0.44 of the next).
    profiled = time_split.engine_split(_gemms)
    split = time_split.scaled_to(profiled, 100.0)
    assert split["wall"] == 100.0 and split["profiled_wall"] == profiled["profiled_wall"]
    assert sum(split[p] for p in time_split.KINDS) == pytest.approx(100.0)
    for part in time_split.KINDS:
        assert split[part] / 100.0 == pytest.approx(profiled[part] / profiled["wall"])
    assert split["gemm"] > 0


def _rates(ours: float, openvino: float) -> dict[str, dict]:
    rates = {}
    for layer, (k, n) in {"qkv_proj": (64, 96), "lm_head": (64, 1000)}.items():
        for m in time_split.ROWS:
            rate = {"ours": ours, "openvino": openvino}
            rates[f"{k}x{n}@{m}"] = {"layer": layer, "rows": m, "flops": 2 * m * k * n, **rate}
    return rates


def test_the_peers_gemm_estimate_follows_the_measured_rates():
    split = {"gemm": 12.0, "attention": 3.0, "other_ops": 2.0, "outside_ops": 1.0, "wall": 18.0}
    mix = time_split.token_mix(prompt_tokens=1000, output_tokens=500)
    result = time_split.side_by_side(split, _rates(ours=50.0, openvino=100.0), mix, 10.0)
    assert result["gemm_speed_openvino_vs_ours"] == pytest.approx(2.0)
    assert result["openvino_seconds"]["gemm_estimated"] == pytest.approx(6.0)
    assert result["openvino_seconds"]["everything_else"] == pytest.approx(4.0)
    lines = "\n".join(time_split.report_lines(result, threads=1))
    assert "| everything but GEMMs | 6.0 s | ~4.0 s |" in lines


def test_the_lm_head_counts_at_decode_sizes_only():
    rates = _rates(ours=50.0, openvino=50.0)
    for rate in rates.values():
        if rate["layer"] == "lm_head" and rate["rows"] >= 512:
            rate["openvino"] = 1e-9  # would dominate if prefill rows counted
    split = {"gemm": 10.0, "attention": 0.0, "other_ops": 0.0, "outside_ops": 0.0, "wall": 10.0}
    mix = time_split.token_mix(prompt_tokens=1000, output_tokens=500)
    result = time_split.side_by_side(split, rates, mix, 12.0)
    assert result["gemm_speed_openvino_vs_ours"] == pytest.approx(1.0)
