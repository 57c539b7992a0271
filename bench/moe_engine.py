"""Mixture-of-experts engine throughput: LLMEngine against `transformers` static-batch `generate`
on a random-weight Qwen3-MoE checkpoint, in one process.

The checkpoint (default hidden 512, 6 layers, 16 experts of intermediate 256, top-2 renormalised,
GQA 8/2, vocab 8192) is built in a temp dir with a word-level tokenizer. The workload: 32
requests with seeded random prompt (32-256 tokens) and output lengths (32-128 tokens), EOS
ignored, greedy; figures are useful output tokens per second (as bench.engine):

- engine: `LLMEngine.generate`, all requests at once, on a fresh engine each run. On CPU each
  sparse layer runs every expert once over all its tokens on oneDNN-packed linears; on CUDA the
  fused MoE Triton kernel;
- hf_static: `generate` on batches of `static_batch` (16) left-padded prompts, with the faster of
  transformers' experts implementations `eager` (its per-expert loop) and `grouped_mm` on this
  machine, each timed on a short warm-up workload (both times recorded). `batched_mm` is left
  out: it gathers one weight matrix per (token, expert) pair, 33.5 s on that warm-up workload
  against 0.7 s for eager on the CPU of bench/results.

Greedy outputs are checked against plain `generate` before timing (the run stops in float32 if
they differ) and between the systems after. The systems run interleaved, `--repeats` times.

    python -m bench.moe_engine [--quick] [--dtype float32] [--repeats 1]
                               [--out bench/results/moe_engine.json]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import cli, plots
from bench.engine import EngineRunner, hf_static
from bench.llm import Workload, agreement, load_hf_model, make_workload, workload_record
from bench.skeleton import Benchmark
from bench.summary import target
from bench.timing import spread, time_interleaved, timed
from tooling.checkpoints import Sizes, write_word_level_tokenizer
from tooling.hf_reference import hf_greedy

NAME = "moe_engine"
HEADING = "Mixture-of-experts engine vs transformers"
DEFAULTS = cli.Defaults("float32", threads=0, repeats=1)
HF_EXPERTS = ("eager", "grouped_mm")


@dataclass(frozen=True)
class MoESizes:
    """The random Qwen3-MoE's expert shape on top of a `Sizes` (model and workload)."""

    base: Sizes
    experts: int
    top_k: int
    moe_intermediate: int


FULL = MoESizes(Sizes(512, 1024, 6, 8, 2, 8192, 32, (32, 256), (32, 128), 16), 16, 2, 256)
QUICK = MoESizes(Sizes(128, 256, 2, 4, 2, 1024, 12, (8, 48), (8, 24), 4), 8, 2, 64)
GPU = MoESizes(Sizes(1024, 2048, 12, 16, 4, 32000, 128, (32, 512), (32, 256), 32), 64, 4, 512)


def build_random_qwen3_moe(sizes: MoESizes, out_dir: Path, seed: int) -> tuple[int, int]:
    """A random Qwen3-MoE of `sizes` plus a word-level tokenizer, saved to `out_dir`; returns
    (parameters, parameters active per token)."""
    import torch
    import transformers

    s = sizes.base
    config = transformers.Qwen3MoeConfig(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        moe_intermediate_size=sizes.moe_intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.hidden // s.heads,
        num_experts=sizes.experts,
        num_experts_per_tok=sizes.top_k,
        norm_topk_prob=True,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        # Wide as bench.engine's Llama: clearly separated logits and router scores.
        initializer_range=0.06,
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config)
    model.save_pretrained(out_dir)
    write_word_level_tokenizer(s.vocab, Path(out_dir))
    total = sum(p.numel() for p in model.parameters())
    expert_params = 3 * s.hidden * sizes.moe_intermediate
    active = total - s.layers * (sizes.experts - sizes.top_k) * expert_params
    return total, active


def pick_hf_experts(hf, check: Workload, batch: int) -> tuple[str, dict[str, float]]:
    """transformers' fastest experts implementation on `check` (seconds of each)."""
    seconds = {}
    for name in HF_EXPERTS:
        try:
            hf.set_experts_implementation(name)
            hf_static(hf, check, batch)  # warm-up
            _, seconds[name] = timed(lambda: hf_static(hf, check, batch))()
        except Exception as exc:  # an implementation this torch build lacks
            print(f"transformers experts implementation {name} unusable: {exc}")
    best = min(seconds, key=seconds.get)
    hf.set_experts_implementation(best)
    return best, seconds


def run(args: argparse.Namespace, model_dir: Path) -> dict[str, object]:
    import torch

    device, dtype, dtype_name = cli.setup_torch(args)
    sizes = {"quick": QUICK, "cuda": GPU, "cpu": FULL}[cli.mode(args.quick, device)]
    workload = make_workload(sizes.base, args.seed)
    num_params, active = build_random_qwen3_moe(sizes, model_dir, args.seed)
    print(
        f"model: Qwen3-MoE {num_params / 1e6:.1f}M parameters ({active / 1e6:.1f}M active), "
        f"{dtype_name} on {device}; {sizes.base.requests} requests, "
        f"{sum(map(len, workload.prompts))} prompt tokens, {workload.num_output_tokens} output "
        "tokens",
        flush=True,
    )
    engine = EngineRunner(model_dir, dtype_name, device, max_num_seqs=max(64, sizes.base.requests))
    hf = load_hf_model(model_dir, device, dtype_name)
    check = Workload(workload.prompts[:4], [16] * 4)
    reference = [hf_greedy(hf, p, 16) for p in check.prompts]
    fidelity = {
        "engine": agreement(engine.run(check)[0], reference),
        "hf_static": agreement(hf_static(hf, check, 2), reference),
    }
    print(f"greedy agreement with generate on {len(check.prompts)} requests: {fidelity}")
    if dtype == torch.float32 and fidelity["engine"]["requests"] < 1.0:
        raise SystemExit("the engine's greedy outputs differ from transformers generate")
    hf_experts, hf_experts_seconds = pick_hf_experts(hf, check, sizes.base.static_batch)
    print(f"transformers experts implementation: {hf_experts} ({hf_experts_seconds})")
    engine.phase_seconds.clear()
    systems = {
        "engine": lambda: engine.run(workload),
        "hf_static": timed(lambda: hf_static(hf, workload, sizes.base.static_batch)),
    }
    seconds, outputs = time_interleaved(systems, args.repeats)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    tokens = workload.num_output_tokens
    engine_seconds = sum(seconds["engine"])
    forward_share = engine.phase_seconds["model_forward"] / engine_seconds
    ratio = median["hf_static"] / median["engine"]
    return {
        "device": str(device),
        "dtype": dtype_name,
        "model": {
            **asdict(sizes.base),
            "architecture": "Qwen3MoeForCausalLM",
            "experts": sizes.experts,
            "top_k": sizes.top_k,
            "moe_intermediate": sizes.moe_intermediate,
            "parameters": num_params,
            "active_parameters": active,
        },
        "workload": workload_record(workload, args.seed),
        "repeats": args.repeats,
        "seconds": seconds,
        "output_tokens_per_second": {name: tokens / t for name, t in median.items()},
        "output_tokens_per_second_spread": {
            name: spread([tokens / t for t in s]) for name, s in seconds.items()
        },
        "ratio_vs_hf_static": ratio,
        "model_forward_share": forward_share,
        "fidelity_vs_generate": fidelity,
        "agreement_with_engine": {"hf_static": agreement(outputs["engine"], outputs["hf_static"])},
        "summary": {"engine_moe_vs_hf_static": ratio},
        "settings": {
            "engine": asdict(engine.config),
            "hf_static_batch": sizes.base.static_batch,
            "hf_attn_implementation": "sdpa",
            "hf_experts_implementation": hf_experts,
            "hf_experts_check_seconds": hf_experts_seconds,
            "torch_threads": torch.get_num_threads(),
        },
    }


def report(result: dict) -> list[str]:
    """Markdown section of the benchmark report."""
    model, work = result["model"], result["workload"]
    rates = result["output_tokens_per_second_spread"]
    settings = result["settings"]
    names = {
        "engine": "our engine (grouped experts, continuous batching, paged KV)",
        "hf_static": f"transformers `generate`, static batches of {model['static_batch']}, "
        f"experts `{settings['hf_experts_implementation']}`",
    }
    lines = [
        f"Random-weight Qwen3-MoE, {model['parameters'] / 1e6:.1f}M parameters "
        f"({model['active_parameters'] / 1e6:.1f}M active; {model['layers']} layers, hidden "
        f"{model['hidden']}, {model['experts']} experts of {model['moe_intermediate']}, top-"
        f"{model['top_k']}, GQA {model['heads']}/{model['kv_heads']}), {result['dtype']} on "
        f"{result['device']}, {settings['torch_threads']} torch thread(s). {work['requests']} "
        f"requests, prompts {model['prompt_len'][0]}-{model['prompt_len'][1]} tokens, outputs "
        f"{model['output_len'][0]}-{model['output_len'][1]} tokens (ignore_eos, greedy). Greedy "
        f"tokens agree with plain `generate` before timing ({result['fidelity_vs_generate']}); "
        f"transformers runs its fastest experts implementation here (check workload seconds: "
        f"{settings['hf_experts_check_seconds']}).",
        "",
        "| system | output tokens/s (median) | min | max |",
        "|---|---|---|---|",
    ]
    for name, rate in rates.items():
        lines.append(
            f"| {names[name]} | {rate['median']:.1f} | {rate['min']:.1f} | {rate['max']:.1f} |"
        )
    lines += [
        "",
        f"- engine / static `generate`: **{result['summary']['engine_moe_vs_hf_static']:.2f}x** "
        f"(target >= {target('engine_moe_vs_hf_static'):g}x); model forward "
        f"{result['model_forward_share']:.3f} of the engine's time",
    ]
    return lines


def plot(result: dict, out_dir: Path) -> list[Path]:
    """Bar chart of output tokens/s per system."""
    rates = result["output_tokens_per_second_spread"]
    names = list(rates)
    medians, errors = plots.medians_and_errors(rates.values())
    fig, ax = plots.pyplot().subplots(figsize=(6, 3.5))
    ax.bar(names, medians, yerr=errors, color=["tab:green", "tab:gray"][: len(names)])
    ax.set_ylabel("output tokens/s")
    ax.set_title(
        f"MoE engine vs transformers ({result['workload']['requests']} requests, "
        f"{result['dtype']}, {result['device']})"
    )
    for x, y in enumerate(medians):
        ax.annotate(f"{y:.0f}", (x, y), ha="center", va="bottom")
    return [plots.save(fig, out_dir / "moe_engine_throughput.png", dpi=110)]


BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, plot)

if __name__ == "__main__":
    BENCHMARK.main()
