#!/usr/bin/env python3
"""LLM engine throughput: LLMEngine against `transformers` static-batch `generate` and against
`transformers` continuous batching (the manager behind `generate_batch`), in one process.

A random-weight Llama-architecture checkpoint (default hidden 512, 8 layers, 8 heads, 2 KV heads,
vocab 8192: about 32M parameters) is built in a temp dir. The workload is `--requests` requests
with seeded random prompt lengths (default 32-512 tokens) and output lengths (32-256 tokens),
EOS ignored, greedy. Figures are useful output tokens per second (the requested tokens only):

- engine: `LLMEngine.generate`, all requests at once (continuous batching, paged KV cache), on a
  fresh engine each run so repeats get no prefix-cache hits from earlier runs;
- hf_static: `generate` on batches of `--static-batch` left-padded prompts; each batch runs to its
  longest output (the waste of static batching);
- hf_continuous: `model.continuous_batching_context_manager()` with one `add_request` per request
  and its own max_new_tokens (`generate_batch` is this loop with a single max_new_tokens).

Greedy outputs are compared before timing (a few requests against plain `generate`) and after
(every request, between systems). The systems run interleaved, `--repeats` times, in rotating
order, so background load hits all alike; ratios of medians are reported. The engine's time is
split into model forward (`ModelRunner.compute_logits`) and the rest, per step phase.

    python scripts/bench_engine.py [--quick] [--dtype float32] [--repeats 1]
                                   [--out bench/results/engine.json] [--profile engine.txt]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine_info, progress, spread, write_result  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    static_batch: int


FULL = Sizes(
    hidden=512,
    intermediate=1536,
    layers=8,
    heads=8,
    kv_heads=2,
    vocab=8192,
    requests=64,
    prompt_len=(32, 512),
    output_len=(32, 256),
    static_batch=16,
)
QUICK = Sizes(
    hidden=128,
    intermediate=256,
    layers=2,
    heads=4,
    kv_heads=2,
    vocab=1024,
    requests=16,
    prompt_len=(8, 64),
    output_len=(8, 32),
    static_batch=4,
)
# GPU mode: a ~0.5B-parameter model and a workload big enough to fill the device.
GPU = Sizes(
    hidden=1536,
    intermediate=4096,
    layers=16,
    heads=12,
    kv_heads=4,
    vocab=32000,
    requests=256,
    prompt_len=(32, 512),
    output_len=(32, 256),
    static_batch=32,
)


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(sizes: Sizes, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(sizes.requests):
        length = rng.randint(*sizes.prompt_len)
        prompts.append([rng.randrange(3, sizes.vocab) for _ in range(length)])
        output_lens.append(rng.randint(*sizes.output_len))
    return Workload(prompts, output_lens)


# --- the checkpoint ------------------------------------------------------------------------------


def build_checkpoint(sizes: Sizes, out_dir: Path, seed: int) -> int:
    """Random Llama checkpoint plus a word-level tokenizer; returns the parameter count."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    config = transformers.LlamaConfig(
        vocab_size=sizes.vocab,
        hidden_size=sizes.hidden,
        intermediate_size=sizes.intermediate,
        num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.kv_heads,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        # Wider than HF's 0.02: clearly separated logits, so greedy paths are robust to rounding.
        initializer_range=0.06,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(out_dir)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, sizes.vocab)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
            }
        )
    )
    return sum(p.numel() for p in model.parameters())


# --- the three systems ---------------------------------------------------------------------------


class EngineRunner:
    """Runs a workload on a fresh LLMEngine each time (an empty prefix cache, as the other
    systems start with), timing each phase of its steps."""

    def __init__(self, model_dir: Path, dtype: str, device, max_num_seqs: int = 64):
        from backend_lib.llm.config import LLMConfig

        self.config = LLMConfig(
            model=str(model_dir), dtype=dtype, max_model_len=1024, max_num_seqs=max_num_seqs
        )
        self.config.validate()
        self.model_dir, self.device = model_dir, device
        self.phase_seconds: dict[str, float] = defaultdict(float)

    def run(self, workload: Workload) -> tuple[list[list[int]], float]:
        """Greedy outputs and the seconds of `generate` (the engine's construction not counted)."""
        from backend_lib.llm.core.sampling_params import SamplingParams

        engine = self._new_engine()
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            for n in workload.output_lens
        ]
        started = time.perf_counter()
        outputs = engine.generate(workload.prompts, params)
        seconds = time.perf_counter() - started
        return [out.outputs[0].token_ids for out in outputs], seconds

    def _new_engine(self):
        from backend_lib.llm.core.engine import LLMEngine

        engine = LLMEngine(self.config, self.model_dir, self.device)
        runner, scheduler = engine.runner, engine.scheduler
        self._time(scheduler, "schedule", "schedule")
        self._time(runner, "apply_block_moves", "block_moves")
        self._time(runner, "prepare_input", "prepare_input")
        self._time(runner, "compute_logits", "model_forward", synchronize=True)
        self._time(runner, "sampler", "sampler", synchronize=True)
        self._time(scheduler, "update", "scheduler_update")
        self._time(engine, "_process_tokens", "detokenize_and_outputs")
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


def _timed(function: Callable[[], list[list[int]]]) -> Callable[[], tuple[list[list[int]], float]]:
    def run() -> tuple[list[list[int]], float]:
        started = time.perf_counter()
        outputs = function()
        return outputs, time.perf_counter() - started

    return run


def hf_reference(model, prompt: list[int], num_tokens: int) -> list[int]:
    import torch

    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=model.device),
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


# --- measuring -----------------------------------------------------------------------------------


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Share of requests with identical outputs, and of tokens before the first difference."""
    same_requests = sum(x == y for x, y in zip(a, b, strict=True))
    prefix = sum(_common_prefix(x, y) for x, y in zip(a, b, strict=True))
    return {"requests": same_requests / len(a), "tokens": prefix / sum(len(x) for x in a)}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def time_interleaved(
    systems: dict[str, Callable[[], tuple[list[list[int]], float]]], repeats: int
) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """Each system returns (outputs, seconds); runs rotate order every repeat."""
    seconds: dict[str, list[float]] = {name: [] for name in systems}
    outputs: dict[str, list[list[int]]] = {}
    names = list(systems)
    for rep in range(repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            outputs[name], elapsed = systems[name]()
            seconds[name].append(elapsed)
            progress(f"repeat {rep + 1}/{repeats} {name}: {elapsed:.2f} s")
    return seconds, outputs


def run(args: argparse.Namespace) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        return run_in(args, Path(tmp))


def run_in(args: argparse.Namespace, model_dir: Path) -> dict[str, object]:
    import torch
    import transformers

    from backend_lib.device import resolve_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(args.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    sizes = QUICK if args.quick else GPU if device.type == "cuda" else FULL
    workload = make_workload(sizes, args.seed)
    num_params = build_checkpoint(sizes, model_dir, args.seed)
    print(
        f"model: {num_params / 1e6:.1f}M parameters, {dtype_name} on {device}; "
        f"{sizes.requests} requests, {sum(map(len, workload.prompts))} prompt tokens, "
        f"{workload.num_output_tokens} output tokens",
        flush=True,
    )

    engine = EngineRunner(model_dir, dtype_name, device, max_num_seqs=max(64, sizes.requests))
    hf = (
        transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation="sdpa", local_files_only=True
        )
        .to(device)
        .eval()
    )

    # Fidelity first: a few requests against plain generate (this also warms every system up).
    check = Workload(workload.prompts[:4], [16] * 4)
    reference = [hf_reference(hf, p, 16) for p in check.prompts]
    fidelity = {
        "engine": agreement(engine.run(check)[0], reference),
        "hf_static": agreement(hf_static(hf, check, 2), reference),
        "hf_continuous": agreement(hf_continuous(hf, check)[0], reference),
    }
    print(f"greedy agreement with generate on {len(check.prompts)} requests: {fidelity}")
    if dtype == torch.float32 and fidelity["engine"]["requests"] < 1.0:
        raise SystemExit("the engine's greedy outputs differ from transformers generate")
    engine.phase_seconds.clear()

    systems = {
        "engine": lambda: engine.run(workload),
        "hf_static": _timed(lambda: hf_static(hf, workload, sizes.static_batch)),
        "hf_continuous": lambda: hf_continuous(hf, workload),
    }
    if args.skip_continuous:
        del systems["hf_continuous"]
    seconds, outputs = time_interleaved(systems, args.repeats)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    engine_seconds = sum(seconds["engine"])
    phases = {name: value / engine_seconds for name, value in engine.phase_seconds.items()}
    phases["other"] = 1.0 - sum(phases.values())

    if args.profile:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.002)
        with profiler:
            engine.run(workload)
        args.profile.write_text(profiler.output_text(unicode=True, color=False), encoding="utf-8")

    tokens = workload.num_output_tokens
    return {
        "benchmark": "llm_engine",
        "quick": args.quick,
        "device": str(device),
        "dtype": dtype_name,
        "model": {**asdict(sizes), "parameters": num_params},
        "workload": {
            "requests": sizes.requests,
            "seed": args.seed,
            "prompt_tokens": sum(map(len, workload.prompts)),
            "output_tokens": tokens,
            "ignore_eos": True,
            "greedy": True,
        },
        "repeats": args.repeats,
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
        },
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
        "machine": machine_info(),
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
        "### LLM engine vs transformers",
        "",
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
        f"- engine / static `generate`: **{summary['engine_vs_hf_static']:.2f}x** (target >= 3x)",
    ]
    if "engine_vs_hf_generate_batch" in summary:
        lines.append(
            f"- engine / `generate_batch`: **{summary['engine_vs_hf_generate_batch']:.2f}x** "
            "(target >= 5x)"
        )
    shares = ", ".join(f"{k} {v:.3f}" for k, v in result["engine_time_share"].items())
    lines.append(
        f"- share of engine wall time in the model forward: "
        f"**{summary['forward_time_share']:.3f}** (target >= 0.8); all phases: {shares}"
    )
    return lines


def plot(result: dict, out_dir: Path) -> list[Path]:
    """Bar chart of output tokens/s per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = result["output_tokens_per_second_spread"]
    names = list(rates)
    medians = [rates[n]["median"] for n in names]
    errors = [
        [rates[n]["median"] - rates[n]["min"] for n in names],
        [rates[n]["max"] - rates[n]["median"] for n in names],
    ]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(names, medians, yerr=errors, color=["tab:green", "tab:gray", "tab:blue"][: len(names)])
    ax.set_ylabel("output tokens/s")
    ax.set_title(
        f"LLM engine vs transformers ({result['workload']['requests']} requests, "
        f"{result['dtype']}, {result['device']})"
    )
    for x, y in enumerate(medians):
        ax.annotate(f"{y:.0f}", (x, y), ha="center", va="bottom")
    fig.tight_layout()
    path = out_dir / "engine_throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (< 60 s), for tests")
    parser.add_argument("--out", type=Path, default=Path("bench/results/engine.json"))
    parser.add_argument(
        "--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument("--device", default=None, help="cpu, cuda (default: CUDA if available)")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (0: torch default); on a shared, loaded CPU use 1",
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--skip-continuous", action="store_true", help="leave out transformers continuous batching"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="write a pyinstrument profile of one more engine run here",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    for name, rate in result["output_tokens_per_second"].items():
        print(f"{name:>14}: {rate:8.1f} output tokens/s")
    print(
        f"engine vs hf_static: {result['ratio_vs_hf_static']:.2f}x, vs hf_continuous: "
        f"{result['ratio_vs_hf_continuous'] or float('nan'):.2f}x; model forward share of engine "
        f"time: {result['model_forward_share']:.2f}"
    )
    write_result(args.out, result)


if __name__ == "__main__":
    main()
