"""The peers' side: a process in `.venv-peers` that loads the peer systems and runs them on request,
timing each run itself (the pipe's transfers are not counted, as the engine's construction is not).

Each run's answer also holds the process's CPU seconds (every thread), to show how many cores it
really kept busy. One JSON request a line on stdin, one answer a line on the original stdout; fd 1 is pointed at
stderr first, so nothing a library prints can corrupt the answers. Requests:

    {"op": "load", "system": S, "path": P, "threads": N, "dtype": "float32" | "bfloat16", ...}
    {"op": "generate", "system": S, "prompts": [[ids]], "max_tokens": [n], "outputs": bool}
        -> also "latencies": per request {"ttft", "tpot", "tokens"} where the system times them
    {"op": "encode", "system": S, "texts": [...] (optional: the previous ones), "outputs": bool}
    {"op": "score", "system": S, "windows": [[ids]]} -> "nll": per window, the summed negative
        log-likelihood of its tokens after the first (a system that scores: llama_cpp_scorer)
    {"op": "matmul", "threads": N, "in_features": K, "out_features": N, "rows": M, "seconds": T}
    {"op": "weight_bytes", "path": P, "float_bytes": 2 | 4}: an OpenVINO IR's bytes per token
    {"op": "quit"}

Answers: {"ok": true, ...} or {"ok": false, "error": "..."}. Token ids in and out, never text, so
tokenization cannot differ. Runs with the standard library, numpy and the peers' packages only.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time
import traceback

import numpy as np

LLM_SYSTEMS = (
    "openvino_genai",
    "openvino_genai_stepped",
    "llama_cpp",
    "openvino_genai_prompt_lookup",
    "openvino_genai_pipeline",
    "ctranslate2",
)
ENCODER_SYSTEMS = ("openvino", "onnxruntime")
OV_PRECISION = {"float32": "f32", "bfloat16": "bf16"}


# --- LLMs ----------------------------------------------------------------------------------------


class OpenVINOGenAI:
    """`openvino_genai.ContinuousBatchingPipeline` on CPU: every request added at once with its own
    max_new_tokens, greedy, EOS ignored; prefix caching off (the engine starts each run empty)."""

    def __init__(self, path: str, threads: int, dtype: str, settings: dict):
        import openvino as ov
        import openvino_genai as genai

        self.ov, self.genai = ov, genai
        scheduler = genai.SchedulerConfig()
        scheduler.max_num_batched_tokens = settings["max_num_batched_tokens"]
        scheduler.max_num_seqs = settings["max_num_seqs"]
        scheduler.cache_size = settings["kv_cache_gb"]
        scheduler.enable_prefix_caching = False
        scheduler.dynamic_split_fuse = True
        self.properties = {
            "INFERENCE_NUM_THREADS": threads,
            "INFERENCE_PRECISION_HINT": OV_PRECISION[dtype],
            # settings["kv_cache_precision"]: an 8-bit cache ("u8") instead of dtype's.
            "KV_CACHE_PRECISION": settings.get("kv_cache_precision") or OV_PRECISION[dtype],
        }
        self.pipe = genai.ContinuousBatchingPipeline(path, scheduler, "CPU", self.properties)
        self.info = {
            "scheduler": {k: getattr(scheduler, k) for k in _SCHEDULER_FIELDS},
            "properties": self.properties,
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
            "openvino": ov.__version__,
            "openvino_genai": genai.__version__,
        }

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        configs = []
        for n in max_tokens:
            config = self.genai.GenerationConfig()
            config.max_new_tokens = n
            config.ignore_eos = True
            config.do_sample = False
            configs.append(config)
        inputs = [self.ov.Tensor(np.asarray([p], dtype=np.int64)) for p in prompts]
        results = self.pipe.generate(inputs, configs)
        return [list(r.m_generation_ids[0]) for r in results]


_SCHEDULER_FIELDS = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "cache_size",
    "enable_prefix_caching",
    "dynamic_split_fuse",
)


class OpenVINOGenAIPipeline:
    """`openvino_genai.LLMPipeline`, one request at a time, greedy, EOS ignored. With
    `prompt_lookup` (settings; system "openvino_genai_prompt_lookup") it is OpenVINO GenAI's
    prompt-lookup speculative decoding, `num_assistant_tokens` drafts per step from n-grams of up
    to `max_ngram_size` tokens; without (system "openvino_genai_pipeline"), plain decoding."""

    def __init__(self, path: str, threads: int, dtype: str, settings: dict):
        import openvino as ov
        import openvino_genai as genai

        self.ov, self.genai = ov, genai
        self.properties = {
            "INFERENCE_NUM_THREADS": threads,
            "INFERENCE_PRECISION_HINT": OV_PRECISION[dtype],
            "KV_CACHE_PRECISION": OV_PRECISION[dtype],
        }
        self.lookup = bool(settings.get("prompt_lookup"))
        self.pipe = genai.LLMPipeline(path, "CPU", prompt_lookup=self.lookup, **self.properties)
        self.num_assistant_tokens = settings.get("num_assistant_tokens")
        self.max_ngram_size = settings.get("max_ngram_size")
        self.info = {
            "prompt_lookup": self.lookup,
            "num_assistant_tokens": self.num_assistant_tokens,
            "max_ngram_size": self.max_ngram_size,
            "properties": self.properties,
            "openvino": ov.__version__,
            "openvino_genai": genai.__version__,
        }

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        outputs = []
        for prompt, n in zip(prompts, max_tokens, strict=True):
            config = self.genai.GenerationConfig()
            config.max_new_tokens = n
            config.ignore_eos = True
            config.do_sample = False
            if self.lookup:
                config.num_assistant_tokens = self.num_assistant_tokens
                config.max_ngram_size = self.max_ngram_size
            ids = self.ov.Tensor(np.asarray([prompt], dtype=np.int64))
            result = self.pipe.generate(ids, config)
            outputs.append(list(result.tokens[0]))
        return outputs


class OpenVINOGenAIStepped:
    """`openvino_genai.ContinuousBatchingPipeline` driven request by request: every request added
    at once (`add_request`), then `step()` until all finish, each new token's arrival timed, so
    each request's time to first token and time per output token are known (`latencies`).
    Greedy, EOS ignored, prefix caching off; settings as `OpenVINOGenAI`'s."""

    def __init__(self, path: str, threads: int, dtype: str, settings: dict):
        self.batched = OpenVINOGenAI(path, threads, dtype, settings)
        self.info = self.batched.info
        self.latencies: list[dict] = []

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        ov, genai, pipe = self.batched.ov, self.batched.genai, self.batched.pipe
        clock = StreamClock(len(prompts))
        handles = []
        for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
            config = genai.GenerationConfig()
            config.max_new_tokens = n
            config.ignore_eos = True
            config.do_sample = False
            ids = ov.Tensor(np.asarray([prompt], dtype=np.int64))
            handles.append(pipe.add_request(i, ids, config))
        outputs: list[list[int]] = [[] for _ in prompts]
        while pipe.has_non_finished_requests():
            pipe.step()
            for i, handle in enumerate(handles):
                if handle.can_read():
                    for out in handle.read().values():
                        outputs[i] += list(out.generated_ids)
                        clock.tokens(i, len(outputs[i]))
        self.latencies = clock.latencies()
        return outputs


class StreamClock:
    """Each request's token arrivals since the clock started: its time to first token and its
    time per output token after the first (vLLM's TPOT), in seconds."""

    def __init__(self, requests: int):
        self.started = time.perf_counter()
        self.first: list[float | None] = [None] * requests
        self.last: list[float | None] = [None] * requests
        self.count = [0] * requests

    def tokens(self, request: int, count: int) -> None:
        """`request` now has `count` tokens in all."""
        now = time.perf_counter()
        if self.first[request] is None:
            self.first[request] = now
        self.last[request], self.count[request] = now, count

    def latencies(self) -> list[dict]:
        return [
            {
                "ttft": first - self.started,
                "tpot": (last - first) / (n - 1) if n > 1 else None,
                "tokens": n,
            }
            for first, last, n in zip(self.first, self.last, self.count, strict=True)
            if first is not None and last is not None
        ]


_GGML_TYPES = {"F32": 0, "F16": 1, "BF16": 30}
"""ggml's type ids (ggml.h's enum ggml_type) for a KV cache type."""


class LlamaCpp:
    """llama.cpp through llama-cpp-python's `Llama` on a GGUF file, one request at a time (its
    Python API decodes one sequence): the KV cache emptied before each request (no prefix reuse,
    as the engine starts empty), the prompt's token ids given as they are (no BOS added), greedy
    (temperature 0: llama.cpp's greedy sampler), EOS ignored; each token's arrival timed."""

    def __init__(self, path: str, threads: int, dtype: str, settings: dict):
        import llama_cpp

        kv_type = settings.get("kv_cache_type")  # None: llama.cpp's default (F16)
        kv = {} if kv_type is None else dict.fromkeys(("type_k", "type_v"), _GGML_TYPES[kv_type])
        self.llm = llama_cpp.Llama(
            model_path=path,
            n_ctx=settings["n_ctx"],
            n_batch=settings["n_batch"],
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
            **kv,
        )
        self.latencies: list[dict] = []
        self.info = {
            "kv_cache_type": kv_type or "F16",
            "n_ctx": settings["n_ctx"],
            "n_batch": settings["n_batch"],
            "n_threads": threads,
            "llama_cpp_python": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode(),
        }

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        outputs, latencies = [], []
        for prompt, n in zip(prompts, max_tokens, strict=True):
            self.llm.reset()
            clock = StreamClock(1)
            tokens: list[int] = []
            stream = self.llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0)
            for token in stream:
                tokens.append(int(token))
                clock.tokens(0, len(tokens))
                if len(tokens) == n:
                    break
            outputs.append(tokens)
            latencies += clock.latencies()
        self.latencies = latencies
        return outputs


class LlamaCppScorer:
    """llama.cpp (llama-cpp-python's `Llama`, keeping every position's logits: `logits_all`)
    scoring windows of token ids, one at a time: each evaluated from an empty KV cache, its ids
    given as they are (no BOS added), in one batch; its negative log-likelihood is `window_nll`
    of the logits llama.cpp returns (float32, taken to float64). Settings: n_ctx (at least the
    longest window), kv_cache_type (F32, F16: llama.cpp's default, or BF16)."""

    def __init__(self, path: str, threads: int, dtype: str, settings: dict):
        import llama_cpp

        kv_type = settings.get("kv_cache_type", "F16")
        self.llm = llama_cpp.Llama(
            model_path=path,
            n_ctx=settings["n_ctx"],
            n_batch=settings["n_ctx"],  # a window is one batch
            logits_all=True,
            n_threads=threads,
            n_threads_batch=threads,
            type_k=_GGML_TYPES[kv_type],
            type_v=_GGML_TYPES[kv_type],
            verbose=False,
        )
        self.info = {
            "kv_cache_type": kv_type,
            "n_ctx": self.llm.n_ctx(),
            "n_threads": threads,
            "llama_cpp_python": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode(),
        }

    def score(self, windows: list[list[int]]) -> list[float]:
        nll = []
        for window in windows:
            self.llm.reset()  # the next eval starts at position 0, the cache's entries dropped
            self.llm.eval(window)
            nll.append(window_nll(self.llm.scores[: len(window)], window))
        return nll


def window_nll(logits: np.ndarray, window: list[int]) -> float:
    """The summed negative log-likelihood of window[1:], each token under the logits of the
    position before it (logits [len(window), vocab]; the last row scores nothing), from a
    log-softmax in float64."""
    rows = np.asarray(logits[: len(window) - 1], dtype=np.float64)
    top = rows.max(axis=1, keepdims=True)
    log_norm = top[:, 0] + np.log(np.exp(rows - top).sum(axis=1))
    chosen = rows[np.arange(len(rows)), np.asarray(window[1:])]
    return float((log_norm - chosen).sum())


class CTranslate2:
    """`ctranslate2.Generator.generate_batch` (static batching: CTranslate2 has no continuous
    batching) over batches of `static_batch` requests in arrival order, each run to its longest
    output, as transformers' static `generate` in the engine benchmark; greedy, no end token."""

    def __init__(self, path: str, threads: int, dtype: str, settings: dict):
        import ctranslate2

        self.generator = ctranslate2.Generator(
            path, device="cpu", compute_type=dtype, intra_threads=threads, inter_threads=1
        )
        with open(os.path.join(path, "vocabulary.json"), encoding="utf-8") as f:
            self.vocabulary = json.load(f)
        self.static_batch = settings["static_batch"]
        self.info = {
            "compute_type": self.generator.compute_type,
            "intra_threads": threads,
            "static_batch": self.static_batch,
            "ctranslate2": ctranslate2.__version__,
        }

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        outputs = []
        for start in range(0, len(prompts), self.static_batch):
            batch = prompts[start : start + self.static_batch]
            lens = max_tokens[start : start + self.static_batch]
            results = self.generator.generate_batch(
                [[self.vocabulary[i] for i in p] for p in batch],
                max_length=max(lens),
                sampling_topk=1,
                end_token=[],
                include_prompt_in_result=False,
            )
            outputs += [r.sequences_ids[0][:n] for r, n in zip(results, lens, strict=True)]
        return outputs


# --- encoders ------------------------------------------------------------------------------------


class Encoder:
    """Sentence embeddings the sentence-transformers way (texts sorted by length, batches of
    `batch_size` padded to their longest, mean pooling, L2 normalization) on a runtime's model of
    the encoder; tokenized with the checkpoint's tokenizer.json (`tokenizers`)."""

    def __init__(self, path: str, settings: dict):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(settings["max_seq_length"])
        self.batch_size = settings["batch_size"]

    def encode(self, texts: list[str]) -> np.ndarray:
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        out = None
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            encodings = self.tokenizer.encode_batch([texts[i] for i in rows])
            width = max(len(e.ids) for e in encodings)
            ids = np.zeros((len(rows), width), dtype=np.int64)
            types = np.zeros_like(ids)
            mask = np.zeros_like(ids)
            for row, e in enumerate(encodings):
                ids[row, : len(e.ids)] = e.ids
                types[row, : len(e.ids)] = e.type_ids
                mask[row, : len(e.ids)] = 1
            hidden = self.forward(ids, mask, types)
            weights = mask[:, :, None].astype(hidden.dtype)
            pooled = (hidden * weights).sum(1) / np.maximum(weights.sum(1), 1e-9)
            pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
            if out is None:
                out = np.empty((len(texts), pooled.shape[1]), dtype=np.float32)
            out[rows] = pooled
        return out

    def forward(self, ids: np.ndarray, mask: np.ndarray, types: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class OpenVINOEncoder(Encoder):
    """The optimum-intel export compiled by OpenVINO's CPU plugin (dynamic shapes, one stream)."""

    def __init__(self, path: str, threads: int, dtype: str, settings: dict):
        import openvino as ov

        super().__init__(path, settings)
        self.properties = {
            "INFERENCE_NUM_THREADS": threads,
            "INFERENCE_PRECISION_HINT": OV_PRECISION[dtype],
            "NUM_STREAMS": 1,
            "PERFORMANCE_HINT": "LATENCY",
        }
        core = ov.Core()
        model = core.read_model(os.path.join(path, "openvino_model.xml"))
        self.inputs = {i.get_any_name() for i in model.inputs}
        self.request = core.compile_model(model, "CPU", self.properties).create_infer_request()
        self.info = {"properties": self.properties, "openvino": ov.__version__}

    def forward(self, ids, mask, types):
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        self.request.infer({k: v for k, v in feeds.items() if k in self.inputs})
        return self.request.get_output_tensor(0).data.astype(np.float32, copy=False)


class OnnxRuntimeEncoder(Encoder):
    """The ONNX export in an ONNX Runtime CPU session (all graph optimizations, sequential)."""

    def __init__(self, path: str, threads: int, dtype: str, settings: dict):
        import onnxruntime as ort

        if dtype != "float32":
            raise ValueError("ONNX Runtime runs the encoder in float32 only here")
        super().__init__(path, settings)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(
            os.path.join(path, "model.onnx"), options, providers=["CPUExecutionProvider"]
        )
        self.inputs = {i.name for i in self.session.get_inputs()}
        self.info = {"intra_op_num_threads": threads, "onnxruntime": ort.__version__}

    def forward(self, ids, mask, types):
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        return self.session.run(None, {k: v for k, v in feeds.items() if k in self.inputs})[0]


SYSTEMS = {
    "openvino_genai": OpenVINOGenAI,
    "openvino_genai_prompt_lookup": OpenVINOGenAIPipeline,
    "openvino_genai_pipeline": OpenVINOGenAIPipeline,
    "openvino_genai_stepped": OpenVINOGenAIStepped,
    "llama_cpp": LlamaCpp,
    "llama_cpp_scorer": LlamaCppScorer,
    "ctranslate2": CTranslate2,
    "openvino": OpenVINOEncoder,
    "onnxruntime": OnnxRuntimeEncoder,
}


# --- the loop ------------------------------------------------------------------------------------


class Worker:
    def __init__(self):
        self.systems: dict[str, object] = {}
        self.texts: list[str] = []

    def load(self, system: str, path: str, threads: int, dtype: str, settings: dict) -> dict:
        self.systems.pop(system, None)  # free the previous model first
        loaded = SYSTEMS[system](path, threads, dtype, settings)
        self.systems[system] = loaded
        return {"info": loaded.info}

    def generate(self, system: str, prompts, max_tokens, outputs: bool = True) -> dict:
        started, cpu = time.perf_counter(), time.process_time()
        result = self.systems[system].generate(prompts, max_tokens)
        seconds = time.perf_counter() - started
        cpu_seconds = time.process_time() - cpu
        return {
            "seconds": seconds,
            "cpu_seconds": cpu_seconds,
            "outputs": result if outputs else None,
            "latencies": getattr(self.systems[system], "latencies", None),
        }

    def score(self, system: str, windows: list[list[int]]) -> dict:
        started, cpu = time.perf_counter(), time.process_time()
        nll = self.systems[system].score(windows)
        seconds = time.perf_counter() - started
        return {"nll": nll, "seconds": seconds, "cpu_seconds": time.process_time() - cpu}

    def matmul(
        self, threads: int, in_features: int, out_features: int, rows: int, seconds: float
    ) -> dict:
        return {"gflops": _matmul_rate(threads, in_features, out_features, rows, seconds)}

    def weight_bytes(self, path: str, float_bytes: int) -> dict:
        return {"bytes": _ir_weight_bytes(path, float_bytes)}

    def encode(self, system: str, texts=None, outputs: bool = True) -> dict:
        if texts is not None:
            self.texts = texts
        started, cpu = time.perf_counter(), time.process_time()
        embeddings = self.systems[system].encode(self.texts)
        seconds = time.perf_counter() - started
        answer: dict = {"seconds": seconds, "cpu_seconds": time.process_time() - cpu}
        if outputs:
            answer["shape"] = list(embeddings.shape)
            answer["embeddings"] = base64.b64encode(
                embeddings.astype(np.float32).tobytes()
            ).decode()
        return answer


def _ir_weight_bytes(path: str, float_bytes: int) -> int:
    """Weight bytes an OpenVINO LLM IR reads per decoded token: each large constant that reaches
    a MatMul (directly or through its decompression ops), float ones at `float_bytes` per value
    (the inference precision: the CPU plugin converts float weights at compile time), compressed
    ones as stored; the token embedding (reaching a Gather) left out."""
    import openvino as ov

    model = ov.Core().read_model(os.path.join(path, "openvino_model.xml"))
    total = 0
    for op in model.get_ops():
        if op.get_type_name() != "Constant" or not op.get_output_size():
            continue
        values = int(np.prod([int(d) for d in op.get_output_shape(0)]))
        if values < 4096 or _feeds(op) != "MatMul":
            continue
        kind = op.get_element_type()
        total += values * float_bytes if kind.is_real() else values * kind.bitwidth // 8
    return total


def _feeds(op, depth: int = 6) -> str | None:
    """ "MatMul" or "Gather": which one `op`'s value reaches first through elementwise ops."""
    frontier = [op]
    for _ in range(depth):
        consumers = [
            target.get_node()
            for node in frontier
            for output in node.outputs()
            for target in output.get_target_inputs()
        ]
        for node in consumers:
            if node.get_type_name() in ("MatMul", "Gather"):
                return node.get_type_name()
        frontier = consumers
    return None


def _matmul_rate(threads: int, in_features: int, out_features: int, rows: int, seconds: float):
    """GFLOP/s of OpenVINO's MatMul [rows, K] x [N, K]^T (float32, `threads`), timed for ~seconds."""
    import openvino as ov
    from openvino import opset13 as ops

    rng = np.random.default_rng(0)
    x = ops.parameter([rows, in_features], np.float32)
    weight = (rng.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)
    model = ov.Model([ops.matmul(x, ops.constant(weight), False, True)], [x])
    properties = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32"}
    request = ov.Core().compile_model(model, "CPU", properties).create_infer_request()
    data = rng.standard_normal((rows, in_features)).astype(np.float32)
    for _ in range(3):
        request.infer([data])
    calls, started = 0, time.perf_counter()
    while True:
        request.infer([data])
        calls += 1
        elapsed = time.perf_counter() - started
        if elapsed >= seconds and calls >= 5:
            return 2 * rows * in_features * out_features * calls / elapsed / 1e9


def main() -> None:
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # library output goes to stderr
    sys.stdout = sys.stderr
    worker = Worker()
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        if op == "quit":
            break
        try:
            answer = {"ok": True, **getattr(worker, op)(**request)}
        except Exception as exc:  # the benchmark reports it; the worker stays up
            traceback.print_exc()
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
