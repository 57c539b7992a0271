"""The headline figures: their targets, and the summary table of the report.

Every benchmark's result holds a "summary" dict of headline figures; the suite merges them into
summary.json and compares them with TARGETS. The benchmarks' own report sections read their
targets from here too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    key: str
    minimum: float
    """The bound: the least the figure should reach, or with `at_most` the most."""
    claim: str
    when_missed: str = ""
    """The figure as measured and what limits it (from profiling): printed in the report when the
    target is missed."""
    at_most: bool = False
    """A figure where lower is better (a latency ratio): met at or below `minimum`."""

    def met(self, value: float) -> bool:
        return value <= self.minimum if self.at_most else value >= self.minimum

    @property
    def text(self) -> str:
        """ ">= 3" or "<= 2"."""
        return f"{'<=' if self.at_most else '>='} {self.minimum:g}"


REAL_SIZE_MISSES = {
    "c1_bandwidth_fraction_f32": "Measured 0.97 at 1 thread, 0.87 at 2 in a run on a slow spell "
    "of this shared machine (every system's 2-thread decode ~25% below the run before, where it "
    "was 0.92-0.94); the float32 GEMV alone streams at 0.99-1.02 of a plain read "
    "(bench.gemv_bandwidth).",
    "c1_bandwidth_fraction_bf16": "Measured 0.89 at 1 thread, 0.76 at 2 (0.84-0.87 in earlier "
    "runs): the bfloat16 GEMV is arithmetic-bound at 0.88-0.94 of a plain read (vdpbf16ps issues "
    "once every two cycles on this Sapphire Rapids; bench.gemv_bandwidth), and attention, norms and "
    "sampling take ~5% of a step.",
    "c1_bandwidth_fraction_int4": "Measured 0.83 at 1 thread, 0.82 at 2 with the head quantized "
    "(0.601 GB a token; 0.88-0.89 in a run of int4 alone): the 4-bit layers stream at 0.90-0.95 "
    "alone, and the step's other work weighs more against a 25 ms token.",
    "c1_decode_vs_openvino_genai_bf16": "Measured 0.94x at 2 threads (1.26x at 1, where OpenVINO "
    "runs without AMX): both read the same 2.08 GB a token, OpenVINO at 0.81 of the memory limit, "
    "ours at 0.76 in this run (0.99x at 0.87 each in the run before).",
    "c1_decode_vs_llama_cpp_f32": "Measured 1.07x at 2 threads, 1.07x at 1: ours at 0.87-0.97 of "
    "the memory limit, llama.cpp at 0.81-0.90; 1.2x is more than the bandwidth left.",
    "c16_throughput_vs_openvino_genai_bf16": "Measured 1.09x at 2 threads: OpenVINO decodes the "
    "16-row steps faster (72 against 78 ms a token; both run AMX GEMMs, oneDNN's at 16 rows "
    "streams the weights at 0.84 of a plain read), our prefill is faster (time to first token "
    "1.7 against 2.7 s). At 64 requests ours is 1.52x.",
    "small_model_c1_vs_openvino_genai": "Measured 0.91x at both thread counts (3.4 against 3.2 ms "
    "a token at 2 threads). Profiled at 2 threads: the 33 GEMVs take 1.91 ms of a 2.93 ms step "
    "(0.91 of a plain read of the same 113 MB), everything else in the forward 0.37 ms, batch "
    "building and sampling 0.22 ms, and all of it runs at twice its looped cost because the "
    "weights just streamed through the caches. What is left is a captured step.",
}
"""bench.real_sizes' missed targets: the figures as measured and where the time goes."""


def _real_size(key: str, minimum: float, claim: str) -> Target:
    """A bench.real_sizes target: on CPU, the worse of 1 and 2 threads; its miss text if any."""
    claim += " (CPU, worse of 1 and 2 threads)"
    return Target(key, minimum, claim, REAL_SIZE_MISSES.get(key, ""))


TARGETS = (
    Target(
        "engine_vs_hf_static",
        3.0,
        "engine output tokens/s vs transformers static-batch generate",
        "On CPU the model forward is ~97% of the engine's time; its projections (~60%) are the "
        "same GEMMs transformers runs, already at the core's float32 peak (~100-110 GFLOP/s), so "
        "the gain is the padding we do not compute. Attention is ~27%: decode attention gathers "
        "the paged KV blocks per step on CPU (memory-bound; the Triton kernel reads blocks in "
        "place on GPU). Transformers' time varies more between runs than ours.",
    ),
    Target(
        "engine_vs_hf_generate_batch",
        5.0,
        "engine output tokens/s vs transformers generate_batch (continuous batching)",
        "As for engine_vs_hf_static: the forward's GEMMs bound both systems on CPU.",
    ),
    Target(
        "engine_moe_vs_hf_static",
        3.0,
        "engine output tokens/s vs transformers static-batch generate, random Qwen3-MoE "
        "(transformers on its fastest experts implementation)",
    ),
    Target("forward_time_share", 0.8, "share of engine wall time inside the model forward"),
    Target(
        "engine_int8_vs_float32",
        1.3,
        "engine output tokens/s with int8 weights (quantization: int8) vs float32, same workload",
        "On CPU the int8 layers run fbgemm's W8A8-dynamic GEMM, fast where the CPU has AVX-512 "
        "VNNI (the Zen 4 machine of bench/results: 1.97x the float32 engine). On an AVX2-only CPU "
        "it is ~1.2x: the int8 GEMMs gain less there, and the attention and the per-token "
        "activation scaling (abs, amax, div, mul), which int8 weights do not speed up, keep the "
        "ratio under 1.3x.",
    ),
    Target(
        "engine_w4a16_vs_bf16",
        1.3,
        "engine output tokens/s on a W4A16 (group 128, symmetric) compressed-tensors checkpoint vs "
        "the float checkpoint in bfloat16, decode-bound workload (worst of 1 and 2 threads)",
        "Measured 1.36x at 1 thread, 1.49x at 2 with the 4-bit layers' int8 activations "
        "(`w4a16_activations: auto` on AVX512-VNNI; 16 requests, at most 16 rows a step, medians of "
        "3 repeats on a 2-core AMD EPYC). Without them (`w4a16_activations: bfloat16`, or a CPU "
        "without VNNI) it measured 1.12x at 1 thread: the bf16-dot 4-bit op is only ~1.4x the bf16 "
        "GEMMs at 16 rows, where this CPU runs both compute-bound, and attention, norms and the "
        "Python around the ops stay.",
    ),
    Target(
        "engine_w4a16_vs_openvino_genai_int4",
        1.0,
        "the same W4A16 engine vs OpenVINO GenAI on its own int4 export (group 128, symmetric), "
        "CPU (worst of 1 and 2 threads)",
        "Measured 1.20x at 1 thread, 1.17x at 2 with int8 activations (OpenVINO's CPU plugin "
        "quantizes them too, by default); with bfloat16 activations it measured 1.10x and 0.93x: "
        "the GEMMs then are not behind OpenVINO's, but the fixed cost per step (the Python around "
        "the ops, ~1 s a run) is what its compiled graph does not pay.",
    ),
    Target(
        "prefix_cache_ttft_reduction",
        0.8,
        "time-to-first-token cut by prefix caching (shared system prompt)",
    ),
    Target(
        "vlm_vs_hf_generate",
        3.0,
        "vision-language output tokens/s, engine (16 requests at once) vs transformers' batched "
        "generate, same Llava checkpoint, prompts and images",
    ),
    Target(
        "clip_image_embedding_vs_transformers",
        1.5,
        "CLIP image embeddings/s, the embedding model (dtype auto) vs transformers' processor and "
        "get_image_features in float32, 32 images a call",
    ),
    Target(
        "kv_offload_ttft_p50_ratio",
        3.0,
        "median time to first token, offload tier off over on, multi-turn agents sharing a system "
        "prompt with a working set 4x the KV pool",
    ),
    Target(
        "kv_offload_throughput_ratio",
        1.5,
        "output tokens/s, offload tier on over off, the same agent workload",
    ),
    Target(
        "lora_mixed_vs_base",
        0.7,
        "engine output tokens/s of a workload over 4 LoRA adapters + base vs the base model alone",
    ),
    Target("kv_slot_utilization", 0.95, "tokens held / KV slots allocated at the engine's peak"),
    Target(
        "concurrency_gain_vs_preallocation",
        3.0,
        "sequences fitting a KV budget, paged vs preallocating max_model_len (2048)",
    ),
    Target(
        "served_vs_direct",
        0.9,
        "output tokens/s through tritonserver vs the engine in-process",
        "Inside the Python backend the engine steps slower under many streams: the client, the "
        "server frontend, the stub's responder thread and the engine share the CPU cores, and "
        "every response is a round trip to the server process (see the inter-token latencies).",
    ),
    Target(
        "embedding_vs_sentence_transformers",
        1.5,
        "items/s vs SentenceTransformer.encode",
        "GEMMs are ~80% of both systems' time and ours already run on packed weights without "
        "padding; sentence-transformers sorts by length too, so there is little padding to save.",
    ),
    Target("rerank_vs_cross_encoder", 1.5, "items/s vs CrossEncoder.predict"),
    Target(
        "decoder_embedding_vs_sentence_transformers",
        1.5,
        "a Qwen3 last-token embedder's items/s vs SentenceTransformer.encode, same texts and "
        "threads, float32, CPU",
    ),
    Target(
        "llm_rerank_vs_cross_encoder",
        1.5,
        "a Qwen3 ForSequenceClassification reranker's items/s vs CrossEncoder.predict, same "
        "pairs and threads, float32, CPU",
    ),
    Target(
        "causal_llm_rerank_vs_cross_encoder",
        1.5,
        "a Qwen3 causal-LM reranker's (chat template, yes/no logits) items/s vs "
        "CrossEncoder.predict, same pairs and threads, float32, CPU",
    ),
    Target(
        "openai_vs_grpc",
        0.95,
        "streaming chat output tokens/s through the OpenAI frontend vs gRPC to tritonserver",
        "Latency, not CPU: per streamed token the benchmark's aiohttp client plus the frontend "
        "spend about what the direct gRPC client alone spends (~0.17 + ~0.21 ms vs ~0.35 ms of "
        "CPU: the report's client CPU line; the frontend's measured from /proc), and the ratio "
        "barely moves with a core left free (0.92 with the server's engine on 1 thread, 0.89 on "
        "2; `--threads 1`, 5 repeats). What the frontend adds is one more hop per request and "
        "per token: TTFT +20-60 ms at p50 (16 closed-loop requests arrive together and pass one "
        "event loop in turn: pydantic validation, the chat template, counting prompt tokens "
        "(~0.2 ms), opening a gRPC stream) and inter-token latency +2-5% (each token wakes the "
        "grpc.aio poller thread and then the event loop, which writes the SSE chunk; py-spy: "
        "those wakeups and grpc.aio's reads dominate, orjson + uvicorn's write are small). With "
        "48 tokens a request (~1.3 s), those two add ~2.5% and ~3.5% to each request's life.",
    ),
    Target(
        "structured_vs_free",
        0.9,
        "engine output tokens/s with half the requests JSON-schema constrained vs unconstrained",
    ),
    Target(
        "engine_vs_openvino_genai",
        1.0,
        "engine output tokens/s vs OpenVINO GenAI continuous batching, float32, CPU (worst of 1 "
        "and 2 threads)",
        "Measured 1.11x at 1 thread, 1.07x at 2 (medians of 3 interleaved repeats; single "
        "runs move ~3% on this shared machine). Both run their GEMMs at this CPU's peak (11.3 s "
        "of our 15.2 s at 1 thread; OpenVINO's MatMul on the model's shapes 0.87-0.93x our packed "
        "oneDNN linears), so the rest decides: ours is the paged attention (2.3 s at 1 thread; "
        "at 2 threads decode reads the KV cache near this machine's memory bandwidth, ~40 GB/s), "
        "the small ops (0.6 s) and the Python around the ops (~0.9 s, which does not shrink with "
        "threads). The levers left: the float32 QK tile's horizontal sums (keys along rows; a "
        "key-major K layout would remove them) and the last layer's attention for rows nobody "
        "samples.",
    ),
    Target(
        "engine_bf16_vs_openvino_genai_bf16",
        1.0,
        "the same in bfloat16 (run only where the CPU has native bf16)",
        "Measured 1.15x at 1 thread, 1.09x at 2 (medians of 3 repeats). bf16 GEMMs take half the "
        "float32 time, so the fixed Python per step weighs twice as much; the attention computes "
        "its bf16 scores and P @ V with AVX512-BF16's dot product (vdpbf16ps).",
    ),
    Target(
        "engine_kv_int8_vs_openvino_genai",
        1.0,
        "the same over 8-bit KV caches: the engine's kv_cache_dtype int8 vs OpenVINO GenAI's "
        "KV_CACHE_PRECISION u8, float32 weights, CPU (worst of 1 and 2 threads)",
    ),
    Target(
        "engine_vs_ctranslate2",
        1.0,
        "engine output tokens/s vs CTranslate2 (static batches of 16), float32, CPU",
    ),
    Target(
        "spec_ngram_vs_plain_c1",
        1.5,
        "n-gram speculative decoding vs plain decoding, one request at a time, on prompts whose "
        "answers quote them (the default LLM, float32, CPU)",
    ),
    Target(
        "spec_draft_vs_plain_c1",
        1.3,
        "speculative decoding with the shipped one-layer draft model vs plain decoding, one "
        "request at a time, on the same prompts (the default LLM, float32, CPU)",
    ),
    *(
        _real_size(
            f"c1_bandwidth_fraction_{p}",
            0.9,
            f"{p} decode at one request, 1B Llama shape: "
            "weight bytes per token x tokens/s / a plain read's bytes/s on the same threads",
        )
        for p in ("f32", "bf16", "int4")
    ),
    *(
        _real_size(
            f"c1_decode_vs_openvino_genai_{p}",
            minimum,
            f"{p} decode tokens/s at one request vs OpenVINO GenAI, 1B Llama shape",
        )
        for p, minimum in (("f32", 1.0), ("bf16", 1.0), ("int4", 1.5))
    ),
    *(
        _real_size(
            f"c1_decode_vs_llama_cpp_{p}",
            1.2,
            f"{p} decode tokens/s at one request vs "
            "llama.cpp on the same GGUF file, 1B Llama shape",
        )
        for p in ("f32", "bf16", "q4_0")
    ),
    *(
        _real_size(
            f"c16_throughput_vs_openvino_genai_{p}",
            1.2,
            f"{p} output tokens/s with 16 "
            "requests at once vs OpenVINO GenAI's continuous batching, 1B Llama shape",
        )
        for p in ("bf16", "int4")
    ),
    *(
        Target(
            f"gguf_perplexity_vs_llama_cpp_{key}",
            0.01,
            f"held-out perplexity of the default model written as a {kind} GGUF file, the engine "
            "vs llama.cpp on the same file and token ids: abs(ours - llama.cpp) / llama.cpp",
            at_most=True,
        )
        for key, kind in (("q8_0", "Q8_0"), ("q4_k", "Q4_K (Q4_K_M mix)"), ("q4_0", "Q4_0"))
    ),
    Target(
        "small_model_c1_vs_openvino_genai",
        1.0,
        "decode tokens/s at one request on the default benchmark model (32.5M parameters, "
        "float32) vs OpenVINO GenAI (CPU, worse of 1 and 2 threads)",
        REAL_SIZE_MISSES["small_model_c1_vs_openvino_genai"],
    ),
    Target(
        "spec_ngram_vs_openvino_genai_prompt_lookup_c1",
        1.0,
        "n-gram speculative decoding vs OpenVINO GenAI's prompt-lookup pipeline (the same k and "
        "longest n-gram), one request at a time, float32, CPU",
    ),
    Target(
        "spec_ngram_vs_plain_c16",
        0.95,
        "n-gram speculative decoding vs plain decoding, 16 requests at once (speculation off above "
        "speculative_disable_by_batch_size)",
    ),
    Target(
        "embedding_vs_openvino",
        1.0,
        "embedding items/s vs OpenVINO, float32, CPU (worst of 1 and 2 threads)",
        "Measured 1.14x at 1 thread, 1.08x at 2 (medians of 3 interleaved repeats). Under "
        "profile the embedder is ~81% GEMMs, ~13% attention (SDPA), the rest GELU and LayerNorm. "
        "The GEMMs keep their rate while their [tokens, 4*hidden] activations stay in cache: the "
        "up-projection runs at 64-72 GFLOP/s on micro-batches of 2048-4096 tokens and ~54 at "
        "16384 (100 MB of activations), so on CPU max_batch_tokens auto is 4096 tokens.",
    ),
    Target(
        "qos_interactive_ttft_p99_vs_alone",
        2.0,
        "interactive requests' TTFT p99 beside a 256-request batch flood under "
        "scheduling_policy priority, over their TTFT p99 alone (max_num_batched_tokens 64)",
        "The step in flight yields to the arrival at a layer boundary (interruptible_steps): it "
        "waits about one layer, then its own step, which still carries the running decodes.",
        at_most=True,
    ),
    Target(
        "qos_fair_share_interactive_ttft_p99_vs_alone",
        3.0,
        "the same under fair_share, no priorities",
        "As for priority, except that the arrival's own step also carries the flood's prefill "
        "chunks in the budget its prompt leaves (fair share orders tokens between tenants, not "
        "latency classes).",
        at_most=True,
    ),
    Target(
        "qos_priority_batch_throughput_vs_fcfs",
        0.9,
        "the flood's output tokens/s under priority vs fcfs",
    ),
    Target(
        "qos_fair_share_batch_throughput_vs_fcfs",
        0.9,
        "the flood's output tokens/s under fair share vs fcfs",
    ),
    Target(
        "qos_embedding_interactive_p99_vs_alone",
        2.0,
        "single short embedding requests' latency p99 beside a flood of large ones (the flood at "
        "priority 1), over their p99 alone",
        at_most=True,
    ),
    Target(
        "embedding_bf16_vs_openvino_bf16",
        1.0,
        "the same in bfloat16 (run only where the CPU has native bf16)",
    ),
)


def target(key: str) -> float:
    """The bound a headline figure should reach (its `Target.minimum`)."""
    return next(t.minimum for t in TARGETS if t.key == key)


def target_of(key: str) -> Target | None:
    """The key's target, None where it has none."""
    return next((t for t in TARGETS if t.key == key), None)


def collect_summary(results: dict[str, dict]) -> tuple[dict[str, float], dict[str, str]]:
    """Merge every result's "summary" dict; returns (figures, key -> benchmark that gave it)."""
    figures: dict[str, float] = {}
    sources: dict[str, str] = {}
    for name, result in results.items():
        for key, value in (result.get("summary") or {}).items():
            if isinstance(value, int | float) and math.isfinite(value):
                figures[key] = float(value)
                sources[key] = name
    return figures, sources


def collect_missing(results: dict[str, dict], figures: dict[str, float]) -> dict[str, str]:
    """Headline figures a benchmark ran but could not measure (its result's "missing": key ->
    why, e.g. a peer system not built in --quick mode), not given by another benchmark."""
    return {
        key: f"{name}: {why}"
        for name, result in results.items()
        for key, why in (result.get("missing") or {}).items()
        if key not in figures
    }


def not_measured(missing: dict[str, str]) -> list[str]:
    """Report lines naming each headline figure not measured, with why."""
    lines = [f"- `{key}`: {why}" for key, why in sorted(missing.items())]
    return ["### Figures not measured", "", *lines, ""] if lines else []


def summary_table(figures: dict[str, float]) -> list[str]:
    lines = ["| figure | measured | target | met | what |", "|---|---|---|---|---|"]
    for t in TARGETS:
        value = figures.get(t.key)
        shown = "n/a" if value is None else f"{value:.3g}"
        met = "n/a" if value is None else ("yes" if t.met(value) else "**no**")
        lines.append(f"| `{t.key}` | {shown} | {t.text} | {met} | {t.claim} |")
    extra = sorted(set(figures) - {t.key for t in TARGETS})
    lines += [f"| `{key}` | {figures[key]:.3g} | | | |" for key in extra]
    return lines


def missed_targets(figures: dict[str, float]) -> list[str]:
    """Report lines explaining each missed target."""
    lines = []
    for t in TARGETS:
        value = figures.get(t.key)
        if value is not None and not t.met(value) and t.when_missed:
            lines.append(f"- `{t.key}` ({value:.3g}, target {t.text}): {t.when_missed}")
    return ["### Targets not met", "", *lines, ""] if lines else []


def summary_line(name: str, value: float | None, target: str, met: bool | None) -> str:
    """A report section's closing line on its headline figure."""
    shown = "n/a" if value is None else f"{value:.3f}"
    verdict = {True: "met", False: "NOT met", None: "not measured"}[met]
    return f"Target: {name} {target}: measured {shown} — {verdict}."
