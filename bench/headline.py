"""The README's headline figures: which figures of summary.json it shows, and the Markdown block
(a paragraph on the run, then a table) rendered from a summary, between two marker comments.

`python -m bench` rewrites the block whenever it writes the default bench/results/summary.json
in a full (not --quick) run, --only and --report-only included; this module alone rewrites it
from the summary.json already there, or checks it (tests/bench/test_readme_table.py checks it too):

    python -m bench.headline [--check] [--summary bench/results/summary.json] [--readme README.md]

The whole table, with every figure and its target, is the report's (bench/results/report.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from bench.output import duration_text
from bench.summary import target_of

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / "README.md"
SUMMARY = REPO_ROOT / "bench" / "results" / "summary.json"
START = (
    "<!-- headline-table:start: generated from bench/results/summary.json by python -m bench or "
    "python -m bench.headline; do not edit -->"
)
END = "<!-- headline-table:end -->"
NOT_MEASURED = "not measured"


@dataclass(frozen=True)
class Row:
    """One row of the headline table: its figures, shown side by side ("a / b")."""

    label: str
    keys: tuple[str, ...]
    """summary.json keys; each target comes from bench.summary.TARGETS."""
    unit: str = "x"
    """After each value: "x" for a ratio, "" for a fraction."""


ROWS = (
    Row(
        "LLM engine vs OpenVINO GenAI, float32 / bfloat16",
        ("engine_vs_openvino_genai", "engine_bf16_vs_openvino_genai_bf16"),
    ),
    Row("LLM engine vs CTranslate2", ("engine_vs_ctranslate2",)),
    Row(
        "LLM engine vs transformers static `generate` / `generate_batch`",
        ("engine_vs_hf_static", "engine_vs_hf_generate_batch"),
    ),
    Row(
        "int8 weights vs float32 / W4A16 checkpoint vs bfloat16 / vs OpenVINO GenAI int4",
        ("engine_int8_vs_float32", "engine_w4a16_vs_bf16", "engine_w4a16_vs_openvino_genai_int4"),
    ),
    Row(
        "mixture-of-experts engine vs transformers static `generate`", ("engine_moe_vs_hf_static",)
    ),
    Row(
        "1B Llama vs OpenVINO GenAI: one request float32 / bfloat16 / 4-bit, 16 requests bfloat16 "
        "/ 4-bit; the default benchmark model, one request",
        (
            *(f"c1_decode_vs_openvino_genai_{p}" for p in ("f32", "bf16", "int4")),
            *(f"c16_throughput_vs_openvino_genai_{p}" for p in ("bf16", "int4")),
            "small_model_c1_vs_openvino_genai",
        ),
    ),
    Row(
        "1B Llama, one request, vs llama.cpp on the same GGUF: F32 / BF16 / Q4_0",
        tuple(f"c1_decode_vs_llama_cpp_{p}" for p in ("f32", "bf16", "q4_0")),
    ),
    Row(
        "speculative decoding, one request at a time: n-gram / draft model vs plain, n-gram vs "
        "OpenVINO GenAI prompt lookup",
        (
            "spec_ngram_vs_plain_c1",
            "spec_draft_vs_plain_c1",
            "spec_ngram_vs_openvino_genai_prompt_lookup_c1",
        ),
    ),
    Row("half the requests JSON-schema constrained vs none", ("structured_vs_free",)),
    Row(
        "LLM through tritonserver vs in-process / OpenAI frontend vs gRPC",
        ("served_vs_direct", "openai_vs_grpc"),
    ),
    Row("prefix caching: time-to-first-token cut", ("prefix_cache_ttft_reduction",), unit=""),
    Row(
        "KV offload tier on vs off, multi-turn agents with a working set 4x the pool: TTFT p50 / "
        "throughput",
        ("kv_offload_ttft_p50_ratio", "kv_offload_throughput_ratio"),
    ),
    Row(
        "interactive latency p99 beside a batch flood vs alone: LLM priority / LLM fair share / "
        "embedding priority",
        (
            "qos_interactive_ttft_p99_vs_alone",
            "qos_fair_share_interactive_ttft_p99_vs_alone",
            "qos_embedding_interactive_p99_vs_alone",
        ),
    ),
    Row(
        "embedding vs OpenVINO, float32 / bfloat16",
        ("embedding_vs_openvino", "embedding_bf16_vs_openvino_bf16"),
    ),
    Row(
        "embedding vs sentence-transformers / rerank vs CrossEncoder",
        ("embedding_vs_sentence_transformers", "rerank_vs_cross_encoder"),
    ),
    Row(
        "Qwen3 embedder vs sentence-transformers / rerankers (classifier, causal LM) vs "
        "CrossEncoder",
        (
            "decoder_embedding_vs_sentence_transformers",
            "llm_rerank_vs_cross_encoder",
            "causal_llm_rerank_vs_cross_encoder",
        ),
    ),
)


def value_text(summary: dict, key: str, unit: str) -> str:
    """The figure as shown ("1.07x"), bold where it misses its target; "not measured" where
    missing."""
    value = summary.get(key)
    if not isinstance(value, int | float):
        return NOT_MEASURED
    shown = f"{value:.2f}{unit}"
    goal = target_of(key)
    return f"**{shown}**" if goal is not None and not goal.met(value) else shown


def target_text(row: Row) -> str:
    """The row's target: ">= 1" where its figures share one, else each one's (">= 3 / <= 2")."""
    goals = [target_of(key) for key in row.keys]
    if all(goal is None for goal in goals):
        return ""
    texts = ["-" if goal is None else goal.text for goal in goals]
    return texts[0] if len(set(texts)) == 1 else " / ".join(texts)


def table(summary: dict) -> list[str]:
    """The headline table's Markdown lines, from a summary.json's contents."""
    lines = ["| figure | value | target |", "|---|---|---|"]
    for row in ROWS:
        keys = ", ".join(f"`{key}`" for key in row.keys)
        values = [value_text(summary, key, row.unit) for key in row.keys]
        shown = NOT_MEASURED if set(values) == {NOT_MEASURED} else " / ".join(values)
        lines.append(f"| {row.label} ({keys}) | {shown} | {target_text(row)} |")
    return lines


def run_text(summary: dict) -> str:
    """What run the figures come from: when, which mode, how long, on what (all from `summary`)."""
    machine = summary.get("machine") or {}
    versions = summary.get("versions") or machine.get("versions") or {}
    seconds = dict(summary.get("seconds") or {})
    total = seconds.pop("total", None)
    mode = (
        "a `--quick` run (tiny sizes: the figures mean nothing)"
        if summary.get("quick")
        else "a full run"
    )
    if summary.get("gpu"):
        mode += " in GPU mode (`--gpu`)"
    written = f", written {summary['date']}" if summary.get("date") else ""
    took = "(time not recorded)" if total is None else duration_text(total)
    hardware = machine.get("gpu") or machine.get("cpu") or "an unrecorded machine"
    return (
        f"From [bench/results/summary.json](bench/results/summary.json){written}: {mode} of "
        f"`make bench` (`python -m bench`), {plural(len(seconds), 'benchmark')} in {took}, on "
        f"{hardware} with {machine.get('cpu_count', '?')} CPUs, torch {versions.get('torch', '?')}. Ours / "
        "theirs, float32 unless stated; where a benchmark runs 1 and 2 threads, the worse. Bold: "
        "below its target. Every figure, and each benchmark's seconds: "
        "[bench/results/report.md](bench/results/report.md)."
    )


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def block(summary: dict) -> str:
    """The README's generated block, markers included."""
    return "\n".join([START, "", wrap(run_text(summary)), "", *table(summary), "", END])


def wrap(text: str, width: int = 100) -> str:
    """`text` in lines of at most `width` characters, as the README's prose, never inside a
    `code span`."""
    spans = text.split("`")
    kept = "`".join(s.replace(" ", "\0") if i % 2 else s for i, s in enumerate(spans))
    filled = textwrap.fill(kept, width=width, break_long_words=False, break_on_hyphens=False)
    return filled.replace("\0", " ")


def current_block(readme_text: str) -> str:
    """The block now in the README, markers included."""
    start, end = readme_text.find(START), readme_text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the README has no headline block ({START} ... {END})")
    return readme_text[start : end + len(END)]


def with_block(readme_text: str, summary: dict) -> str:
    """The README with its headline block rendered from `summary`."""
    return readme_text.replace(current_block(readme_text), block(summary), 1)


def update_readme(summary: dict, readme: Path | None = None) -> bool:
    """Rewrite the README's (default: this checkout's) headline block from `summary`; whether it
    changed."""
    readme = readme or README
    text = readme.read_text(encoding="utf-8")
    new = with_block(text, summary)
    if new != text:
        readme.write_text(new, encoding="utf-8")
    return new != text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--summary", type=Path, default=SUMMARY)
    parser.add_argument("--readme", type=Path, default=README)
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if the block differs"
    )
    args = parser.parse_args(argv)
    summary = json.loads(args.summary.read_text(encoding="utf-8"))
    if args.check:
        if current_block(args.readme.read_text(encoding="utf-8")) != block(summary):
            sys.exit(f"{args.readme}'s headline table differs from {args.summary}")
        print(f"{args.readme}'s headline table matches {args.summary}")
    else:
        changed = update_readme(summary, args.readme)
        print(f"{'rewrote' if changed else 'unchanged:'} {args.readme}'s headline table")


if __name__ == "__main__":
    main()
