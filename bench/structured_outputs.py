"""Structured outputs: engine throughput with half the requests constrained by a JSON schema, vs
the same workload unconstrained; and grammar compile times.

The default llm (the Shakespeare model, models/shakespeare-llama) runs in-process (`LLMEngine`,
one engine for every run). `--requests` chat prompts, greedy, in three systems:

- structured: every other request constrained by a JSON schema of the test corpus
  (tooling/json_schemas.py, its object schemas in turn; compact JSON) with at most
  `--max-tokens`; it stops when its grammar completes, usually well before. The others generate
  `--max-tokens` tokens, EOS ignored;
- free (the baseline of `structured_vs_free`): every request unconstrained, EOS ignored, each
  generating exactly as many tokens as in the structured run, so both runs have the same output
  tokens and the same batch at every step and the ratio isolates what the constraint costs
  (grammar matchers, the bitmask filled on a worker thread and applied to the logits);
- free_full: every request unconstrained with `--max-tokens` (the same max_tokens): more tokens
  and larger batches late in the run; for reference.

Before timing, the structured run's constrained outputs that stop must parse and validate with
jsonschema and at least half must stop; the unconstrained requests of the structured run must equal
the same requests in the free run (the bitmask touches only its own rows); each system's outputs
must equal between repeats. This first run also compiles the grammars: the timed runs hit the
engine's grammar cache, as a server seeing the same schemas again does. Figures: output tokens/s;
`structured_vs_free` is the median over repeats of structured / free, each repeat running the two
back to back (in alternating order), so that load from elsewhere on a shared machine hits both.

Grammar compile time per schema: cold (a new compiler: the tokenizer's xgrammar vocabulary table,
then the schema), a new schema on a warm compiler, and the same schema again (cached).

Free requests beside constraint compilation (`free_request_latency_during_compile_ratio`): through
the engine loop (serving/engine_loop.py, as the served model runs it), the wall time of
`--free-requests` unconstrained requests submitted together (greedy, `--max-tokens` each), alone
and while three requests whose schema `pattern`s cost seconds to compile (`^(x|y|xy|yx){1,N}$`,
each new to the cache) wait for their grammars; the ratio is the median over repeats of
during / alone, 1 when compiling holds nothing up.

    python -m bench.structured_outputs [--quick] [--requests 64] [--max-tokens 96]
                                       [--repeats 3] [--profile structured.txt]
                                       [--free-requests 4] [--costly-n 2500]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend_lib.llm.core.request import EngineRequest
from bench import cli, plots
from bench.llm import check_same, new_engine
from bench.output import progress
from bench.skeleton import Benchmark
from bench.summary import summary_line, target
from bench.timing import spread

NAME = "structured_outputs"
HEADING = "Structured outputs: JSON-schema constrained vs free generation"
DEFAULTS = cli.Defaults(cli.DEFAULT_DTYPE, threads=1, repeats=cli.ByMode(quick=1, cpu=5))
TARGET = target("structured_vs_free")
SYSTEMS = ("structured", "free", "free_full")
REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO_ROOT / "models" / "shakespeare-llama"
SCENES = ("A street in Verona.", "A hall in Capulet's house.", "Friar Laurence's cell.")
LINES = ("Who goes there?", "What news, my lord?", "Where is Romeo?", "Speak again.")
COMPACT = {"disable_any_whitespace": True}
COSTLY_REQUESTS = 3
COSTLY_COMPILE_TIMEOUT_S = 300.0
"""Compile timeout of the benchmark's engine: long enough for the costly patterns on a busy machine."""


@dataclass(frozen=True)
class Request:
    prompt: str
    schema: dict[str, Any] | None
    """The JSON schema constraining it in the structured run (None: free)."""


def corpus_schemas() -> list[dict[str, Any]]:
    """The object schemas of the structured-outputs test corpus."""
    from tooling.json_schemas import SCHEMAS

    return [s for s in SCHEMAS if s.get("type") == "object" and s.get("properties")]


def make_requests(count: int) -> list[Request]:
    """Chat prompts in the Shakespeare template's shape; every other one constrained."""
    schemas = corpus_schemas()
    requests = []
    for i in range(count):
        scene, line = SCENES[i % len(SCENES)], LINES[(i // len(SCENES)) % len(LINES)]
        prompt = f"[{scene}]\n\nUSER:\n{line} ({i})\n\nASSISTANT:\n"
        schema = schemas[(i // 2) % len(schemas)] if i % 2 == 0 else None
        requests.append(Request(prompt, schema))
    return requests


def structured_params(requests: list[Request], max_tokens: int) -> list:
    from backend_lib.llm.core.sampling_params import SamplingParams

    return [
        SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            structured_outputs={"json": r.schema, **COMPACT},
        )
        if r.schema is not None
        else SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for r in requests
    ]


def free_params(lengths: list[int]) -> list:
    """Unconstrained, exactly `lengths[i]` tokens for request i."""
    from backend_lib.llm.core.sampling_params import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]


@dataclass
class RunResult:
    token_ids: list[list[int]]
    texts: list[str]
    finish_reasons: list[str]
    seconds: float
    bitmask_fill_seconds: float

    @property
    def output_tokens(self) -> int:
        return sum(map(len, self.token_ids))


def run_once(engine, prompts: list[str], params: list) -> RunResult:
    """One `generate` of the whole workload on the engine; its outputs and wall time."""
    engine.stats()  # drain earlier observations
    started = time.perf_counter()
    outputs = engine.generate(prompts, params)
    seconds = time.perf_counter() - started
    fill = sum(engine.stats().bitmask_fill_seconds)
    completions = [o.outputs[0] for o in outputs]
    return RunResult(
        [list(c.token_ids) for c in completions],
        [c.text for c in completions],
        [c.finish_reason for c in completions],
        seconds,
        fill,
    )


def check_constrained(requests: list[Request], run: RunResult) -> dict[str, Any]:
    """Constrained outputs that stopped validate against their schema; at least half stop."""
    import jsonschema

    constrained = [i for i, r in enumerate(requests) if r.schema is not None]
    stopped = [i for i in constrained if run.finish_reasons[i] == "stop"]
    for i in stopped:
        try:
            jsonschema.validate(json.loads(run.texts[i]), requests[i].schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            raise SystemExit(f"request {i}: {run.texts[i]!r} is not valid: {exc}") from None
    if len(stopped) * 2 < len(constrained):
        raise SystemExit(f"only {len(stopped)} of {len(constrained)} constrained outputs stopped")
    lengths = [len(run.token_ids[i]) for i in constrained]
    return {
        "constrained": len(constrained),
        "stopped_and_valid": len(stopped),
        "output_tokens": {"min": min(lengths), "mean": statistics.mean(lengths)},
        "passed": True,
    }


def compile_times(engine, schemas: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Seconds to compile each schema: cold (new compiler), new schema on a warm compiler, and
    cached (the same schema again)."""
    from backend_lib.llm.structured.compiler import GrammarCompiler
    from backend_lib.llm.structured.params import StructuredOutputsParams

    def compiler() -> GrammarCompiler:
        return GrammarCompiler(
            engine.tokenizer, engine.vocab_size, engine.grammar_compiler.stop_token_ids
        )

    specs = [StructuredOutputsParams.from_value({"json": s, **COMPACT}) for s in schemas]
    times: dict[str, list[float]] = {"cold": [], "warm": [], "cached": []}
    for spec in specs:
        fresh = compiler()
        started = time.perf_counter()
        fresh.compile(spec)
        times["cold"].append(time.perf_counter() - started)
        started = time.perf_counter()
        _, compiled = fresh.compile(spec)
        times["cached"].append(time.perf_counter() - started)
        assert compiled is None, "the second compile of a schema must hit the cache"
    warm = compiler()
    warm.compile(StructuredOutputsParams.from_value({"json_object": True}))
    for spec in specs:
        started = time.perf_counter()
        warm.compile(spec)
        times["warm"].append(time.perf_counter() - started)
    return times


def costly_schema(n: int, index: int) -> dict[str, Any]:
    """A string schema whose `pattern` costs seconds to compile at n in the thousands (its
    regex-to-grammar conversion is quadratic in n); `index` picks letters of its own."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    a, b = letters[(2 * index + 2) % 26], letters[(2 * index + 3) % 26]
    return {"type": "string", "pattern": f"^({a}|{b}|{a}{b}|{b}{a}){{1,{n + index // 13}}}$"}


def compile_interference(engine, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Wall time of free requests through an EngineLoop, alone and beside costly compiles."""
    from backend_lib.llm.core.sampling_params import SamplingParams
    from backend_lib.llm.serving.engine_loop import EngineLoop

    def free_batch(loop, tag: str) -> float:
        started = time.perf_counter()
        streams = [
            loop.submit(
                EngineRequest(
                    f"{tag}-{i}", prompts[i % len(prompts)], free_params([args.max_tokens])[0]
                )
            )
            for i in range(args.free_requests)
        ]
        for stream in streams:
            final = list(stream)[-1]
            if final.error is not None or len(final.outputs[0].token_ids) != args.max_tokens:
                raise SystemExit(f"free request {final.request_id} failed: {final.error}")
        return time.perf_counter() - started

    loop = EngineLoop(engine)
    loop.start()
    schemas = iter(costly_schema(args.costly_n, i) for i in range(10_000))
    alone, during, still_compiling, costly_seconds = [], [], [], []
    try:
        warm = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs={"regex": "[ab]"})
        list(
            loop.submit(EngineRequest("warm-compile", prompts[0], warm))
        )  # compile workers started
        free_batch(loop, "warm")
        for rep in range(args.repeats):
            alone.append(free_batch(loop, f"alone-{rep}"))
            started = time.perf_counter()
            costly = [
                loop.submit(
                    EngineRequest(
                        f"costly-{rep}-{i}",
                        prompts[i % len(prompts)],
                        SamplingParams(
                            temperature=0.0,
                            max_tokens=args.max_tokens,
                            structured_outputs={"json": next(schemas)},
                        ),
                    )
                )
                for i in range(COSTLY_REQUESTS)
            ]
            during.append(free_batch(loop, f"during-{rep}"))
            still_compiling.append(engine.grammar_compiler.workers.num_busy)
            for stream in costly:
                final = list(stream)[-1]
                if final.error is not None:
                    raise SystemExit(f"costly request {final.request_id}: {final.error}")
            costly_seconds.append(time.perf_counter() - started)
            progress(
                f"free requests: {alone[-1]:.3f} s alone, {during[-1]:.3f} s beside "
                f"{COSTLY_REQUESTS} compiles ({costly_seconds[-1]:.1f} s until they finished)"
            )
    finally:
        loop.stop(timeout=120)
    return {
        "free_requests": args.free_requests,
        "costly_requests": COSTLY_REQUESTS,
        "costly_pattern": costly_schema(args.costly_n, 0)["pattern"],
        "alone_seconds": alone,
        "during_compile_seconds": during,
        "costly_until_finished_seconds": costly_seconds,
        "compiles_still_running_after_free": still_compiling,
        "ratio_per_repeat": [d / a for d, a in zip(during, alone, strict=True)],
    }


def run(args: argparse.Namespace, _scratch: Path) -> dict:
    import torch

    device, _, dtype = cli.setup_torch(args)
    requests = make_requests(args.requests)
    prompts = [r.prompt for r in requests]
    engine = new_engine(
        MODEL_DIR,
        device,
        dtype,
        max_model_len=1024,
        max_num_seqs=max(64, args.requests),
        # The costly compiles are meant to finish: this measures their interference, not the
        # timeout, and a loaded machine (make test runs the suite beside the other tests) can
        # take several times the usual seconds.
        structured_outputs_compile_timeout_s=COSTLY_COMPILE_TIMEOUT_S,
    )
    progress(
        f"{NAME}: Shakespeare model, {dtype} on {device}, {args.requests} requests "
        f"(half constrained), max_tokens {args.max_tokens}"
    )
    compile_seconds = compile_times(engine, corpus_schemas())
    progress(f"compile cold {statistics.median(compile_seconds['cold']) * 1e3:.1f} ms (median)")

    # Checks (and the grammar cache's warm-up) before timing.
    first = run_once(engine, prompts, structured_params(requests, args.max_tokens))
    fidelity: dict[str, Any] = {"constrained_outputs": check_constrained(requests, first)}
    lengths = [len(ids) for ids in first.token_ids]
    params = {
        "structured": structured_params(requests, args.max_tokens),
        "free": free_params(lengths),
        "free_full": free_params([args.max_tokens] * len(requests)),
    }
    free = [i for i, r in enumerate(requests) if r.schema is None]
    baseline = run_once(engine, prompts, params["free"])
    fidelity["free_rows_untouched"] = check_same(
        "structured",
        [first.token_ids[i] for i in free],
        {"free": [baseline.token_ids[i] for i in free]},
        dtype,
    )
    reference = {"structured": first, "free": baseline}

    runs: dict[str, list[RunResult]] = {name: [] for name in SYSTEMS}
    for rep in range(args.repeats):
        # The compared pair back to back, its order alternating; the reference run last.
        order = ("structured", "free") if rep % 2 == 0 else ("free", "structured")
        for name in (*order, "free_full"):
            result = run_once(engine, prompts, params[name])
            runs[name].append(result)
            reference.setdefault(name, result)
            progress(
                f"repeat {rep + 1}/{args.repeats} {name}: {result.seconds:.2f} s, "
                f"{result.output_tokens / result.seconds:.0f} tokens/s"
            )
        fidelity[f"repeat_{rep + 1}"] = {
            name: check_same(
                name, reference[name].token_ids, {"again": runs[name][-1].token_ids}, dtype
            )
            for name in SYSTEMS
        }
    if runs["structured"][0].output_tokens != runs["free"][0].output_tokens:
        raise SystemExit("structured and free runs generated different numbers of tokens")

    if args.profile:
        write_profile(engine, prompts, params["structured"], args.profile)
    interference = compile_interference(engine, prompts, args)
    rates = {name: [r.output_tokens / r.seconds for r in results] for name, results in runs.items()}
    median = {name: statistics.median(values) for name, values in rates.items()}
    ratios = [c / f for c, f in zip(rates["structured"], rates["free"], strict=True)]
    structured_seconds = [r.seconds for r in runs["structured"]]
    fill = [r.bitmask_fill_seconds for r in runs["structured"]]
    return {
        "device": str(device),
        "dtype": dtype,
        "model": {"dir": str(MODEL_DIR.relative_to(REPO_ROOT)), "name": "shakespeare-llama"},
        "workload": {
            "requests": args.requests,
            "constrained": sum(r.schema is not None for r in requests),
            "schemas": len(corpus_schemas()),
            "max_tokens": args.max_tokens,
            "greedy": True,
            "output_tokens": {name: results[0].output_tokens for name, results in runs.items()},
        },
        "settings": {"torch_threads": torch.get_num_threads(), "json": "compact"},
        "repeats": args.repeats,
        "seconds": {name: [r.seconds for r in results] for name, results in runs.items()},
        "output_tokens_per_second": {name: spread(values) for name, values in rates.items()},
        "bitmask_fill_share": statistics.median(
            f / s for f, s in zip(fill, structured_seconds, strict=True)
        ),
        "compile_seconds": compile_seconds,
        "compile_ms": {
            kind: {"median": statistics.median(v) * 1e3, "max": max(v) * 1e3}
            for kind, v in compile_seconds.items()
        },
        "structured_vs_free_per_repeat": ratios,
        "structured_vs_free_full": median["structured"] / median["free_full"],
        "compile_interference": interference,
        "free_request_latency_during_compile_ratio": statistics.median(
            interference["ratio_per_repeat"]
        ),
        "fidelity": fidelity,
        "summary": {"structured_vs_free": statistics.median(ratios)},
    }


def write_profile(engine, prompts: list[str], params: list, path: Path) -> None:
    """A pyinstrument profile of one more structured run."""
    from pyinstrument import Profiler

    profiler = Profiler(interval=0.002)
    with profiler:
        engine.generate(prompts, params)
    path.write_text(profiler.output_text(unicode=True, color=False), encoding="utf-8")


def report(result: dict) -> list[str]:
    w, rates, ms = result["workload"], result["output_tokens_per_second"], result["compile_ms"]
    c = result.get("compile_interference")  # absent from results older than it
    ratio = result["summary"]["structured_vs_free"]
    check = result["fidelity"]["constrained_outputs"]
    names = {
        "structured": "structured: every other request JSON-schema constrained",
        "free": "free: unconstrained, the same tokens per request",
        "free_full": "free_full: unconstrained, max_tokens each",
    }
    lines = [
        f"The default llm (Shakespeare model) in-process, {result['dtype']} on {result['device']}, "
        f"{result['settings']['torch_threads']} torch thread(s): {w['requests']} greedy chat "
        f"requests, {w['constrained']} of them constrained by the {w['schemas']} object schemas "
        f"of the test corpus in turn (compact JSON, at most {w['max_tokens']} tokens; a "
        "constrained request stops when its grammar completes), the others "
        f"{w['max_tokens']} tokens with EOS ignored. The free run gives each request exactly the "
        "tokens it generated constrained, so both runs have the same batches and output tokens. "
        f"{check['stopped_and_valid']} of {check['constrained']} constrained outputs stopped and "
        "validate with jsonschema; the free requests' tokens are the same in both runs. "
        f"{result['repeats']} repeat(s), structured and free back to back in alternating order; "
        "grammars cached after a first run; the ratio is the median of the repeats' ratios.",
        "",
        "| system | output tokens | tokens/s (median) | min | max |",
        "|---|---|---|---|---|",
    ]
    for name in SYSTEMS:
        rate = rates[name]
        lines.append(
            f"| {names[name]} | {w['output_tokens'][name]} | {rate['median']:.1f} | "
            f"{rate['min']:.1f} | {rate['max']:.1f} |"
        )
    lines += [
        "",
        "| grammar compile, per schema | median (ms) | max (ms) |",
        "|---|---|---|",
        f"| cold: a new compiler (vocabulary table + schema) | {ms['cold']['median']:.1f} | "
        f"{ms['cold']['max']:.1f} |",
        f"| a new schema, warm compiler | {ms['warm']['median']:.2f} | {ms['warm']['max']:.2f} |",
        f"| cached: the same schema again | {ms['cached']['median']:.4f} | "
        f"{ms['cached']['max']:.4f} |",
        "",
        f"Bitmask fill (worker thread, overlapping the forward): "
        f"{result['bitmask_fill_share']:.1%} of the structured run's wall time. "
        f"structured / free_full (the same max_tokens, more tokens): "
        f"{result['structured_vs_free_full']:.3f}.",
        summary_line("structured_vs_free", ratio, f">= {TARGET}", ratio >= TARGET),
    ]
    if c is not None:
        lines[-1:-1] = [
            "",
            f"Free requests beside constraint compilation (engine loop): {c['free_requests']} "
            f"free requests of {w['max_tokens']} tokens took "
            f"{statistics.median(c['alone_seconds']):.3f} s alone and "
            f"{statistics.median(c['during_compile_seconds']):.3f} s while "
            f"{c['costly_requests']} requests waited for costly grammars (`{c['costly_pattern']}`, "
            "compiled in worker processes; "
            f"{statistics.median(c['costly_until_finished_seconds']):.1f} s until they finished): "
            "ratio "
            f"{result['free_request_latency_during_compile_ratio']:.2f} "
            "(`free_request_latency_during_compile_ratio`, 1 = compiling holds nothing up).",
        ]
    return lines


def plot(result: dict, out_dir: Path) -> list[Path]:
    fig, ax = plots.pyplot().subplots(figsize=(6, 3.5))
    rates = result["output_tokens_per_second"]
    medians, errors = plots.medians_and_errors(rates[name] for name in SYSTEMS)
    ax.bar(SYSTEMS, medians, yerr=errors, capsize=4, color=["tab:orange", "tab:blue", "tab:gray"])
    ax.set_ylabel("output tokens/s")
    ax.set_title(
        f"Half the requests JSON-constrained: {result['summary']['structured_vs_free']:.2f}x free"
    )
    return [plots.save(fig, out_dir / f"{NAME}_throughput.png")]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, help="requests (default: %(default)s)")
    parser.add_argument(
        "--max-tokens", type=int, help="most tokens per request (default: %(default)s)"
    )
    parser.add_argument("--profile", type=Path, help="write a pyinstrument profile here")
    parser.add_argument(
        "--free-requests",
        type=int,
        help="free requests timed beside the costly compiles (default: %(default)s)",
    )
    parser.add_argument(
        "--costly-n",
        type=int,
        help="N of the costly patterns ^(x|y|xy|yx){1,N}$ (default: %(default)s)",
    )
    parser.set_defaults(
        free_requests=4,
        costly_n=cli.ByMode(quick=1200, cpu=2500),
        requests=cli.ByMode(quick=8, cpu=64, cuda=256),
        max_tokens=cli.ByMode(quick=24, cpu=96, cuda=128),
    )


BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, plot, add_args)

if __name__ == "__main__":
    BENCHMARK.main()
