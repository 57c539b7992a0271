"""vLLM's speculative-decoding counters from an engine that speculates: every series exists from
load at 0 (positions 0 .. k - 1 included), then they carry the engine's own counts."""

from __future__ import annotations

import json

from prometheus_client import generate_latest

from backend_lib.llm.serving.metrics import EXTRA_LABELS, LLMMetrics
from backend_lib.metrics import PrometheusMetrics, parse_prometheus_text
from tests.llm.engine_helpers import engine_checkpoint, greedy, make_engine, random_prompt

LABELS = {"model": "llm", "version": "1", "model_name": "llm"}
K = 3
SERIES = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def _scrape(sink: PrometheusMetrics) -> dict:
    return parse_prometheus_text(generate_latest(sink.registry).decode())


def _value(scraped: dict, name: str, **extra: str) -> float:
    return scraped[(name, frozenset({**LABELS, **extra}.items()))]


def test_spec_decode_series_from_load_then_the_engines_counts():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    speculative = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1}
    engine = make_engine(model_dir, speculative_config=json.dumps(speculative))
    sink = PrometheusMetrics({"model": "llm", "version": "1"}, extra_labels=EXTRA_LABELS)
    metrics = LLMMetrics(sink.with_labels(model_name="llm"), 128, 8, 64, num_speculative_tokens=K)
    scraped = _scrape(sink)
    assert all(_value(scraped, name) == 0 for name in SERIES)
    assert all(_value(scraped, PER_POS, position=str(p)) == 0 for p in range(K))

    prompt = random_prompt(6, 0) * 4  # repeats: drafts found every step
    engine.generate([prompt, random_prompt(20, 1)], greedy(30))
    stats = engine.stats()
    metrics.update(stats)
    counters, scraped = stats.counters, _scrape(sink)
    assert counters.spec_decode_num_drafts > 0
    assert _value(scraped, SERIES[0]) == counters.spec_decode_num_drafts
    assert _value(scraped, SERIES[1]) == counters.spec_decode_num_draft_tokens
    assert _value(scraped, SERIES[2]) == counters.spec_decode_num_accepted_tokens
    per_pos = counters.spec_decode_num_accepted_tokens_per_pos
    for position in range(K):
        expected = per_pos[position] if position < len(per_pos) else 0
        assert _value(scraped, PER_POS, position=str(position)) == expected


def test_no_spec_decode_series_without_speculation():
    sink = PrometheusMetrics({"model": "llm", "version": "1"}, extra_labels=EXTRA_LABELS)
    LLMMetrics(sink.with_labels(model_name="llm"), 128, 8, 64)
    names = {name for name, _ in _scrape(sink)}
    assert not names & {*SERIES, PER_POS}
