"""LLM engine throughput: LLMEngine against `transformers` static-batch `generate` and against
`transformers` continuous batching (the manager behind `generate_batch`), in one process.

A random-weight Llama-architecture checkpoint (default hidden 512, 8 layers, 8 heads, 2 KV heads,
vocab 8192: about 32M parameters) is built in a temp dir. The workload is 64 requests
(tooling.checkpoints.FULL) with seeded random prompt lengths (default 32-512 tokens) and output lengths (32-256 tokens),
EOS ignored, greedy. Figures are useful output tokens per second (the requested tokens only):

- engine: `LLMEngine.generate`, all requests at once (continuous batching, paged KV cache), on a
  fresh engine each run so repeats get no prefix-cache hits from earlier runs;
- hf_static: `generate` on batches of `static_batch` (16) left-padded prompts; each batch runs to its
  longest output (the waste of static batching);
- hf_continuous: `model.continuous_batching_context_manager()` with one `add_request` per request
  and its own max_new_tokens (`generate_batch` is this loop with a single max_new_tokens);
- engine_int8: the engine with `quantization: int8` (on CPU fbgemm's W8A8-dynamic int8 GEMMs),
  timed interleaved with the others and reported apart ("int8": its rate, its ratio to the float
  engine, its greedy agreement with the float engine, which is reported, not required).

Greedy outputs are compared before timing (a few requests against plain `generate`) and after
(every request, between systems). The systems run interleaved, `--repeats` times, in rotating
order, so background load hits all alike; ratios of medians are reported. The engine's time is
split into model forward (`ModelRunner.compute_logits`) and the rest, per step phase. With
`--profile`, one more run of the engine and of engine_int8 each under torch.profiler splits their
time into GEMMs, attention, other ops and the Python outside them ("time_split", printed too: where
the time goes at each precision), besides a pyinstrument profile of the engine.

    python -m bench.engine [--quick] [--dtype float32] [--repeats 1]
                           [--out bench/results/engine.json] [--profile engine.txt]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from bench import cli, plots
from bench.llm import (
    Workload,
    agreement,
    greedy,
    load_hf_model,
    make_workload,
    new_engine,
    workload_record,
)
from bench.peers.time_split import engine_split
from bench.skeleton import Benchmark
from bench.summary import target
from bench.timing import spread, time_interleaved, timed
from tooling.checkpoints import FULL, GPU, QUICK, build_random_llama
from tooling.hf_reference import hf_greedy

NAME = "engine"
HEADING = "LLM engine vs transformers"
DEFAULTS = cli.Defaults("float32", threads=0, repeats=1)


# --- the three systems ---------------------------------------------------------------------------


class EngineRunner:
    """Runs a workload on a fresh LLMEngine each time (an empty prefix cache, as the other
    systems start with), timing each phase of its steps."""

    def __init__(
        self,
        model_dir: Path,
        dtype: str,
        device,
        max_num_seqs: int = 64,
        quantization: str = "none",
        kv_cache_dtype: str = "auto",
        **settings,
    ):
        """`settings`: further LLMConfig fields."""
        self.model_dir, self.dtype, self.device = model_dir, dtype, device
        self.settings = {
            "max_model_len": 1024,
            "max_num_seqs": max_num_seqs,
            "quantization": quantization,
            "kv_cache_dtype": kv_cache_dtype,
            **settings,
        }
        self.config = None
        """The latest engine's LLMConfig."""
        self.phase_seconds: dict[str, float] = defaultdict(float)

    def run(self, workload: Workload) -> tuple[list[list[int]], float]:
        """Greedy outputs and the seconds of `generate` (the engine's construction not counted)."""
        outputs, seconds = timed(self.prepare(workload))()
        return [out.outputs[0].token_ids for out in outputs], seconds

    def prepare(self, workload: Workload) -> Callable[[], list]:
        """A fresh engine's `generate` of the workload, constructed and ready to call."""
        engine = self._new_engine()
        params = [greedy(n) for n in workload.output_lens]
        return lambda: engine.generate(workload.prompts, params)

    def _new_engine(self):
        engine = new_engine(self.model_dir, self.device, self.dtype, **self.settings)
        self.config = engine.config
        runner, scheduler = engine.runner, engine.scheduler
        self._time(scheduler, "schedule", "schedule")
        self._time(runner, "apply_block_moves", "block_moves")
        self._time(runner, "prepare_input", "prepare_input")
        self._time(runner, "compute_logits", "model_forward", synchronize=True)
        self._time(runner, "sampler", "sampler", synchronize=True)
        self._time(scheduler, "update", "scheduler_update")
        self._time(engine.outputs, "process", "detokenize_and_outputs")
        return engine

    def _time(self, owner, attribute: str, phase: str, synchronize: bool = False) -> None:
        import torch

        inner = getattr(owner, attribute)
        sync = synchronize and self.device.type == "cuda"

        def timed(*args, **kwargs):
            started = time.perf_counter()
            result = inner(*args, **kwargs)
            if sync:
                torch.cuda.synchronize(self.device)
            self.phase_seconds[phase] += time.perf_counter() - started
            return result

        setattr(owner, attribute, timed)


def hf_static(model, workload: Workload, batch_size: int) -> list[list[int]]:
    """`generate` over left-padded batches in arrival order; each batch to its longest output."""
    import torch

    results = []
    for start in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[start : start + batch_size]
        lens = workload.output_lens[start : start + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(model.device),
                attention_mask=mask.to(model.device),
                max_new_tokens=max(lens),
                min_new_tokens=max(lens),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        results += [out[row, width : width + n].tolist() for row, n in enumerate(lens)]
    return results


def hf_continuous(model, workload: Workload) -> tuple[list[list[int]], float]:
    """transformers continuous batching, one request per prompt with its own max_new_tokens.

    Sized like the engine (2048 tokens and 64 requests per step, a cache holding every request);
    without explicit sizes it probes memory, which on CPU can take far longer than the work.
    Returns the outputs and the seconds from the first request to the last result (the manager's
    start-up and shut-down are not counted, as the engine's construction is not).
    """
    import transformers
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 256
    num_blocks = (
        sum(
            -(-(len(p) + n) // page)
            for p, n in zip(workload.prompts, workload.output_lens, strict=True)
        )
        + 16
    )
    cb_config = ContinuousBatchingConfig(
        page_size=page, num_blocks=num_blocks, max_batch_tokens=2048, max_requests_per_batch=64
    )
    config = transformers.GenerationConfig(
        do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(workload.output_lens)
    )
    results: dict[str, list[int]] = {}
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb_config, block=True, timeout=30
    ) as manager:
        started = time.perf_counter()
        ids = [
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n)
            for i, (prompt, n) in enumerate(
                zip(workload.prompts, workload.output_lens, strict=True)
            )
        ]
        while len(results) < len(ids):
            result = manager.get_result(timeout=120)
            if result is None:
                raise RuntimeError("transformers continuous batching stopped producing results")
            if result.is_finished():
                if result.error:
                    raise RuntimeError(f"transformers continuous batching: {result.error}")
                results[result.request_id] = list(result.generated_tokens)
        seconds = time.perf_counter() - started
    return [results[i] for i in ids], seconds


# --- measuring -----------------------------------------------------------------------------------


def run(args: argparse.Namespace, model_dir: Path) -> dict[str, object]:
    import torch

    device, dtype, dtype_name = cli.setup_torch(args)
    sizes = {"quick": QUICK, "cuda": GPU, "cpu": FULL}[cli.mode(args.quick, device)]
    workload = make_workload(sizes, args.seed)
    num_params = build_random_llama(sizes, model_dir, args.seed)
    print(
        f"model: {num_params / 1e6:.1f}M parameters, {dtype_name} on {device}; "
        f"{sizes.requests} requests, {sum(map(len, workload.prompts))} prompt tokens, "
        f"{workload.num_output_tokens} output tokens",
        flush=True,
    )
    engine = EngineRunner(model_dir, dtype_name, device, max_num_seqs=max(64, sizes.requests))
    hf = load_hf_model(model_dir, device, dtype_name)
    fidelity = check_fidelity(engine, hf, workload)
    if dtype == torch.float32 and fidelity["engine"]["requests"] < 1.0:
        raise SystemExit("the engine's greedy outputs differ from transformers generate")
    engine.phase_seconds.clear()
    engine_int8 = EngineRunner(
        model_dir, dtype_name, device, max_num_seqs=max(64, sizes.requests), quantization="int8"
    )
    engine_int8.run(Workload(workload.prompts[:4], [16] * 4))  # warm-up

    systems = {
        "engine": lambda: engine.run(workload),
        "engine_int8": lambda: engine_int8.run(workload),
        "hf_static": timed(lambda: hf_static(hf, workload, sizes.static_batch)),
        "hf_continuous": lambda: hf_continuous(hf, workload),
    }
    if args.skip_continuous:
        del systems["hf_continuous"]
    seconds, outputs = time_interleaved(systems, args.repeats)
    int8 = int8_record(seconds.pop("engine_int8"), seconds["engine"], workload.num_output_tokens)
    int8["agreement_with_float_engine"] = agreement(outputs["engine"], outputs.pop("engine_int8"))
    engine_seconds = sum(seconds["engine"])
    phases = {name: value / engine_seconds for name, value in engine.phase_seconds.items()}
    phases["other"] = 1.0 - sum(phases.values())
    split = None
    if args.profile:
        write_profile(engine, workload, args.profile)
        split = {
            dtype_name: engine_split(
                engine.prepare(workload), statistics.median(seconds["engine"])
            ),
            "int8": engine_split(engine_int8.prepare(workload), statistics.median(int8["seconds"])),
        }
        for name, kinds in split.items():
            print(
                f"where the time goes, {name}: "
                + ", ".join(f"{k} {v:.2f} s" for k, v in kinds.items())
            )
    return {
        "device": str(device),
        "dtype": dtype_name,
        "model": {**asdict(sizes), "parameters": num_params},
        "workload": workload_record(workload, args.seed),
        "repeats": args.repeats,
        **figures(seconds, workload.num_output_tokens, phases, int8["ratio_vs_float_engine"]),
        "int8": int8,
        **({"time_split": split} if split else {}),
        "fidelity_vs_generate": fidelity,
        "agreement_with_engine": {
            name: agreement(outputs["engine"], out)
            for name, out in outputs.items()
            if name != "engine"
        },
        "settings": {
            "engine": asdict(engine.config),
            "hf_static_batch": sizes.static_batch,
            "hf_attn_implementation": "sdpa",
            "torch_threads": torch.get_num_threads(),
        },
    }


def check_fidelity(engine: EngineRunner, hf, workload: Workload) -> dict[str, dict[str, float]]:
    """Each system's greedy agreement with plain `generate` on a few requests (this also warms
    every system up)."""
    check = Workload(workload.prompts[:4], [16] * 4)
    reference = [hf_greedy(hf, p, 16) for p in check.prompts]
    fidelity = {
        "engine": agreement(engine.run(check)[0], reference),
        "hf_static": agreement(hf_static(hf, check, 2), reference),
        "hf_continuous": agreement(hf_continuous(hf, check)[0], reference),
    }
    print(f"greedy agreement with generate on {len(check.prompts)} requests: {fidelity}")
    return fidelity


def write_profile(engine: EngineRunner, workload: Workload, path: Path) -> None:
    """A pyinstrument profile of one more engine run."""
    from pyinstrument import Profiler

    profiler = Profiler(interval=0.002)
    with profiler:
        engine.run(workload)
    path.write_text(profiler.output_text(unicode=True, color=False), encoding="utf-8")


def int8_record(int8: list[float], float_engine: list[float], tokens: int) -> dict[str, object]:
    """The int8 engine's timings against the float engine's (same workload, interleaved)."""
    return {
        "seconds": int8,
        "output_tokens_per_second": tokens / statistics.median(int8),
        "output_tokens_per_second_spread": spread([tokens / t for t in int8]),
        "ratio_vs_float_engine": statistics.median(float_engine) / statistics.median(int8),
    }


def figures(
    seconds: dict[str, list[float]],
    tokens: int,
    phases: dict[str, float],
    int8_ratio: float | None = None,
) -> dict[str, object]:
    """The timings and the figures drawn from them, for the result JSON."""
    median = {name: statistics.median(s) for name, s in seconds.items()}
    return {
        "seconds": seconds,
        "output_tokens_per_second": {name: tokens / t for name, t in median.items()},
        "output_tokens_per_second_spread": {
            name: spread([tokens / t for t in s]) for name, s in seconds.items()
        },
        "ratio_vs_hf_static": median["hf_static"] / median["engine"],
        "ratio_vs_hf_continuous": (
            median["hf_continuous"] / median["engine"] if "hf_continuous" in median else None
        ),
        "engine_time_share": phases,
        "model_forward_share": phases["model_forward"],
        "summary": {
            "engine_vs_hf_static": median["hf_static"] / median["engine"],
            **(
                {"engine_vs_hf_generate_batch": median["hf_continuous"] / median["engine"]}
                if "hf_continuous" in median
                else {}
            ),
            "forward_time_share": phases["model_forward"],
            **({"engine_int8_vs_float32": int8_ratio} if int8_ratio is not None else {}),
        },
    }


def report(result: dict) -> list[str]:
    """Markdown section of the benchmark report."""
    model, work = result["model"], result["workload"]
    rates = result["output_tokens_per_second_spread"]
    names = {
        "engine": "our engine (continuous batching, paged KV)",
        "hf_static": f"transformers `generate`, static batches of {model['static_batch']}",
        "hf_continuous": "transformers `generate_batch` (its continuous batching)",
    }
    lines = [
        f"Random-weight Llama, {model['parameters'] / 1e6:.1f}M parameters ({model['layers']} layers, "
        f"hidden {model['hidden']}, GQA {model['heads']}/{model['kv_heads']}), {result['dtype']} on "
        f"{result['device']}, {result['settings']['torch_threads']} torch thread(s). {work['requests']} "
        f"requests, prompts {model['prompt_len'][0]}-{model['prompt_len'][1]} tokens, outputs "
        f"{model['output_len'][0]}-{model['output_len'][1]} tokens (ignore_eos, greedy): "
        f"{work['prompt_tokens']} prompt and {work['output_tokens']} output tokens. Greedy tokens of "
        "every system agree with plain `generate` before timing "
        f"({result['fidelity_vs_generate']}); {result['repeats']} repeat(s), interleaved.",
        "",
        "| system | output tokens/s (median) | min | max |",
        "|---|---|---|---|",
    ]
    for name, rate in rates.items():
        lines.append(
            f"| {names[name]} | {rate['median']:.1f} | {rate['min']:.1f} | {rate['max']:.1f} |"
        )
    summary = result["summary"]
    lines += [
        "",
        f"- engine / static `generate`: **{summary['engine_vs_hf_static']:.2f}x** "
        f"(target >= {target('engine_vs_hf_static'):g}x)",
    ]
    if "engine_vs_hf_generate_batch" in summary:
        lines.append(
            f"- engine / `generate_batch`: **{summary['engine_vs_hf_generate_batch']:.2f}x** "
            f"(target >= {target('engine_vs_hf_generate_batch'):g}x)"
        )
    if "int8" in result:
        int8 = result["int8"]
        lines.append(
            f"- engine with int8 weights: {int8['output_tokens_per_second']:.1f} output tokens/s, "
            f"**{int8['ratio_vs_float_engine']:.2f}x** the {result['dtype']} engine (target >= "
            f"{target('engine_int8_vs_float32'):g}x); greedy agreement with it "
            f"{int8['agreement_with_float_engine']} (reported, not required)"
        )
    shares = ", ".join(f"{k} {v:.3f}" for k, v in result["engine_time_share"].items())
    lines.append(
        f"- share of engine wall time in the model forward: "
        f"**{summary['forward_time_share']:.3f}** (target >= {target('forward_time_share'):g}); "
        f"all phases: {shares}"
    )
    return lines


def plot(result: dict, out_dir: Path) -> list[Path]:
    """Bar chart of output tokens/s per system."""
    rates = result["output_tokens_per_second_spread"]
    names = list(rates)
    medians, errors = plots.medians_and_errors(rates.values())
    fig, ax = plots.pyplot().subplots(figsize=(6, 3.5))
    ax.bar(names, medians, yerr=errors, color=["tab:green", "tab:gray", "tab:blue"][: len(names)])
    ax.set_ylabel("output tokens/s")
    ax.set_title(
        f"LLM engine vs transformers ({result['workload']['requests']} requests, "
        f"{result['dtype']}, {result['device']})"
    )
    for x, y in enumerate(medians):
        ax.annotate(f"{y:.0f}", (x, y), ha="center", va="bottom")
    return [plots.save(fig, out_dir / "engine_throughput.png", dpi=110)]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--skip-continuous", action="store_true", help="leave out transformers continuous batching"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="write a pyinstrument profile of one more engine run here",
    )


BENCHMARK = Benchmark(
    NAME, HEADING, __doc__, DEFAULTS, run, report, plot, add_args, recorded_as="llm_engine"
)

if __name__ == "__main__":
    BENCHMARK.main()
