"""Multi-LoRA serving: one workload spread over 4 adapters and the base model in one engine, vs the
same workload on the base model alone; and the time to load an adapter.

A random Llama (tooling.checkpoints) gets 4 random PEFT adapters (rank 16, every projection, built
with `peft`). The workload (random prompts, greedy, EOS ignored, all requests at once) runs on two
fresh engines per repeat, in rotating order:

- base: LoRA off, every request on the base model;
- mixed: LoRA on with 4 slots, requests assigned round-robin to base, a0, a1, a2, a3, so every
  step mixes all five (one batched LoRA call per projection).

Reported: output tokens per second of each, their ratio (`lora_mixed_vs_base`), and the adapter
load time: from disk (read + validate, `LoRARegistry.request` on a cold cache) and into a device
slot. Fidelity: the mixed run's base requests must give the base run's tokens (float32: exactly),
and adapters must change the outputs.

    python -m bench.lora [--quick] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from bench import cli, plots
from bench.llm import check_same, greedy, make_workload
from bench.output import progress
from bench.skeleton import Benchmark
from bench.summary import summary_line, target
from bench.timing import spread, timed
from tooling.checkpoints import Sizes, build_random_llama

NAME = "lora"
HEADING = "Multi-LoRA: 4 adapters + base in one engine vs the base model alone"
DEFAULTS = cli.Defaults(cli.DEFAULT_DTYPE, threads=1, repeats=cli.ByMode(quick=1, cpu=3))
TARGET = target("lora_mixed_vs_base")
NUM_ADAPTERS = 4
RANK = 16
SYSTEMS = ("base", "mixed")

PRESETS = {
    "quick": Sizes(128, 256, 2, 4, 2, 1024, requests=10, prompt_len=(8, 32), output_len=(8, 16)),
    "cpu": Sizes(512, 1536, 4, 8, 2, 4096, requests=40, prompt_len=(32, 128), output_len=(32, 96)),
    "cuda": Sizes(
        1536, 4096, 16, 12, 4, 32000, requests=160, prompt_len=(32, 256), output_len=(64, 192)
    ),
}


def build_adapters(model_dir: Path, out_dir: Path, seed: int) -> dict[str, Path]:
    import torch
    import transformers

    from tooling.lora_adapters import build_lora_adapter

    base = transformers.LlamaForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, local_files_only=True
    )
    adapters = {}
    for i in range(NUM_ADAPTERS):
        adapters[f"a{i}"] = out_dir / f"a{i}"
        build_lora_adapter(base, adapters[f"a{i}"], rank=RANK, alpha=2 * RANK, seed=seed + i)
    return adapters


def new_engine(model_dir: Path, device, dtype: str, lora_modules=None, **settings):
    """A fresh LLMEngine with these LLMConfig settings, serving `lora_modules`."""
    from backend_lib.llm.config import LLMConfig
    from backend_lib.llm.engine.llm_engine import LLMEngine

    config = LLMConfig(model=str(model_dir), dtype=dtype, **settings)
    config.validate()
    return LLMEngine(config, model_dir, device, lora_modules=lora_modules)


def load_times(model_dir: Path, device, dtype: str, adapters: dict[str, Path]) -> dict:
    """Milliseconds to load each adapter from disk (cold host cache) and into a device slot."""
    engine = new_engine(
        model_dir,
        device,
        dtype,
        enable_lora=True,
        max_loras=1,
        max_lora_rank=RANK,
        max_cpu_loras=NUM_ADAPTERS,
        lora_modules=adapters,
    )
    disk, slot = [], []
    for name in adapters:
        request = engine.lora_registry.request(name)
        disk.append(engine.lora_registry.load_seconds[-1] * 1e3)
        started = time.perf_counter()
        engine.runner.lora_slots.activate([request])
        if device.type == "cuda":
            import torch

            torch.cuda.synchronize(device)
        slot.append((time.perf_counter() - started) * 1e3)
    return {"disk_ms": disk, "slot_ms": slot}


def lora_time_share(run_mixed) -> float:
    """Share of a mixed run's wall time spent in the LoRA computation (every `LoRABatch.apply`:
    the shrink and expand over the step's segments), from one untimed run of `run_mixed`."""
    from backend_lib.llm.lora.batch import LoRABatch

    spent, original = 0.0, LoRABatch.apply

    def timed_apply(self, *args):
        nonlocal spent
        started = time.perf_counter()
        out = original(self, *args)
        spent += time.perf_counter() - started
        return out

    LoRABatch.apply = timed_apply
    try:
        _, seconds = run_mixed()
    finally:
        LoRABatch.apply = original
    return spent / seconds


def run(args: argparse.Namespace, root: Path) -> dict:
    device, _, dtype = cli.setup_torch(args)
    sizes = PRESETS[cli.mode(args.quick, device)]
    model_dir = root / "model"
    max_model_len = sizes.prompt_len[1] + sizes.output_len[1]
    num_params = build_random_llama(sizes, model_dir, args.seed, max_positions=max_model_len)
    adapters = build_adapters(model_dir, root, args.seed)
    workload = make_workload(sizes, args.seed)
    names = [None, *adapters]
    lora_names = [names[i % len(names)] for i in range(len(workload.prompts))]
    params = [greedy(n) for n in workload.output_lens]
    common = dict(max_model_len=max_model_len, max_num_seqs=len(workload.prompts))
    settings = {
        "base": common,
        "mixed": {**common, "enable_lora": True, "max_loras": NUM_ADAPTERS, "max_lora_rank": RANK},
    }
    progress(
        f"{NAME}: {num_params / 1e6:.1f}M parameters, {dtype} on {device}, {sizes.requests} "
        f"requests over base + {NUM_ADAPTERS} adapters (rank {RANK})"
    )

    def run_system(name: str) -> tuple[list[list[int]], float]:
        extra = {"lora_modules": adapters} if name == "mixed" else {}
        engine = new_engine(model_dir, device, dtype, **settings[name], **extra)
        loras = lora_names if name == "mixed" else None
        outputs, seconds = timed(lambda: engine.generate(workload.prompts, params, loras))()
        return [o.outputs[0].token_ids for o in outputs], seconds

    runs: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    outputs: dict[str, list[list[int]]] = {}
    for rep in range(args.repeats):
        for name in SYSTEMS[rep % 2 :] + SYSTEMS[: rep % 2]:
            outputs[name], seconds = run_system(name)
            runs[name].append(seconds)
            progress(f"repeat {rep + 1}/{args.repeats} {name}: {seconds:.2f} s")
    on_base = [i for i, n in enumerate(lora_names) if n is None]
    fidelity = check_same(
        "base",
        [outputs["base"][i] for i in on_base],
        {"mixed_base_requests": [outputs["mixed"][i] for i in on_base]},
        dtype,
    )
    on_adapter = [i for i, n in enumerate(lora_names) if n is not None]
    changed = sum(outputs["mixed"][i] != outputs["base"][i] for i in on_adapter) / len(on_adapter)
    if changed < 0.5:
        raise SystemExit(f"adapters changed only {changed:.0%} of their outputs")
    fidelity["adapter_outputs_changed"] = changed
    tokens = workload.num_output_tokens
    rate = {name: spread([tokens / s for s in seconds]) for name, seconds in runs.items()}
    ratios = [b / m for b, m in zip(runs["base"], runs["mixed"], strict=True)]
    lora_share = lora_time_share(lambda: run_system("mixed"))
    loads = load_times(model_dir, device, dtype, adapters)
    load_ms = {key: spread(values) for key, values in loads.items()}
    return {
        "device": str(device),
        "dtype": dtype,
        "model": {**asdict(sizes), "parameters": num_params},
        "adapters": {"count": NUM_ADAPTERS, "rank": RANK, "targets": "all 7 projections"},
        "workload": {
            "requests": sizes.requests,
            "prompt_len": sizes.prompt_len,
            "output_len": sizes.output_len,
            "output_tokens": tokens,
            "assignment": "round-robin over base + adapters",
            "seed": args.seed,
        },
        "settings": {"engines": settings, "torch_threads": args.threads},
        "repeats": args.repeats,
        "seconds": runs,
        "output_tokens_per_second": rate,
        "mixed_vs_base_per_repeat": ratios,
        "load_ms": load_ms,
        "load_ms_raw": loads,
        "profile": {"lora_share_of_mixed_run": lora_share},
        "fidelity": fidelity,
        "summary": {
            "lora_mixed_vs_base": statistics.median(ratios),
            "lora_adapter_load_ms": load_ms["disk_ms"]["median"] + load_ms["slot_ms"]["median"],
        },
    }


def report(result: dict) -> list[str]:
    w, rate, load = result["workload"], result["output_tokens_per_second"], result["load_ms"]
    ratio = result["summary"]["lora_mixed_vs_base"]
    return [
        f"{w['requests']} requests (prompts {w['prompt_len'][0]}-{w['prompt_len'][1]}, outputs "
        f"{w['output_len'][0]}-{w['output_len'][1]} tokens) at once, round-robin over the base "
        f"model and {result['adapters']['count']} rank-{result['adapters']['rank']} adapters on "
        f"every projection; median of {result['repeats']} run(s), {result['dtype']} on "
        f"{result['device']}. Base requests give the base run's tokens.",
        "",
        "| system | output tok/s (min-max) |",
        "|---|---|",
        *(
            f"| {name} | {rate[name]['median']:.0f} ({rate[name]['min']:.0f}-"
            f"{rate[name]['max']:.0f}) |"
            for name in SYSTEMS
        ),
        "",
        f"Adapter load: {load['disk_ms']['median']:.1f} ms from disk (read + validate), "
        f"{load['slot_ms']['median']:.1f} ms into a device slot (medians).",
        "",
        f"Profile (one more mixed run, untimed): the LoRA computation (shrink and expand over the "
        f"step's adapter segments, every projection of every layer) takes "
        f"{result['profile']['lora_share_of_mixed_run']:.1%} of its wall time; the rest is the "
        "base model's forward and the engine, as in the base run, so that share is what the "
        "adapters should cost; single repeats on a shared machine vary by more (per-repeat "
        f"ratios: {', '.join(f'{r:.2f}' for r in result['mixed_vs_base_per_repeat'])}).",
        "",
        summary_line("lora_mixed_vs_base", ratio, f">= {TARGET}", ratio >= TARGET),
    ]


def plot(result: dict, out_dir: Path) -> list[Path]:
    fig, ax = plots.pyplot().subplots(figsize=(5, 4))
    ax.bar(SYSTEMS, [result["output_tokens_per_second"][s]["median"] for s in SYSTEMS])
    ax.set_ylabel("output tokens/s")
    ax.set_title("Base alone vs base + 4 LoRA adapters")
    return [plots.save(fig, out_dir / f"{NAME}_throughput.png")]


BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, plot)

if __name__ == "__main__":
    BENCHMARK.main()
