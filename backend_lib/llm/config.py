"""LLMConfig: every engine setting, filled from `config.pbtxt` parameters and validated once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from backend_lib import contract
from backend_lib.config import require
from backend_lib.llm import cuda_graph_config, kv_offload_config
from backend_lib.llm.kv_events_config import KVEventsConfig
from backend_lib.llm.multimodal_config import MultiModalConfig
from backend_lib.llm.speculative_config import SpeculativeConfig
from backend_lib.multimodal.images import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS
from backend_lib.quantization import QUANTIZATION_SETTINGS

W4A16_ACTIVATIONS = ("auto", "bfloat16", "int8")


@dataclass
class LLMConfig:
    """Engine settings. Names follow vLLM's engine arguments where one exists."""

    model: str = ""
    """Checkpoint directory (config.json, *.safetensors, tokenizer.json), or a `.gguf` file
    (backend_lib/gguf_checkpoint.py); relative to the model dir."""
    gguf_file: str = ""
    """The `.gguf` file in the `model` directory to load (transformers' gguf_file); "": none."""
    dtype: str = "auto"
    """auto, float32, bfloat16 or float16. auto: bfloat16 on CUDA and on CPUs with native
    bfloat16 (AVX512-BF16 or AMX), float32 on other CPUs (see `backend_lib.device.resolve_dtype`)."""
    quantization: Literal["auto", "none", "int8", "fp8"] = "auto"
    """Weight quantization of the projections. auto: a pre-quantized checkpoint (its
    `quantization_config`: compressed-tensors W4A16/W8A16/W8A8/FP8) loads as stored
    (backend_lib/llm/execution/checkpoint_quantization/), any other checkpoint as none. At load
    from a full-precision checkpoint (`backend_lib.quantization`): none; int8 (per-output-channel
    symmetric int8 weights; on CPU the layers run fbgemm's W8A8-dynamic int8 GEMM, on CUDA a
    weight-only Triton kernel); fp8 (float8_e4m3fn weights, per-channel scales, CUDA only).
    The lm_head is quantized too (a tied one gets its own int8 copy); embeddings and norms stay
    in `dtype`. A draft model has its own setting (`speculative_config`'s `quantization`)."""
    w4a16_activations: Literal["auto", "bfloat16", "int8"] = "auto"
    """What a pre-quantized checkpoint's 4-bit weight-only layers (compressed-tensors, GPTQ, AWQ)
    multiply with on CPU in bfloat16 (kernels/wna16_linear.py): bfloat16, the activations as they
    are (AVX512-BF16 dot products); int8, each row quantized at the call per weight group of at
    most 256 inputs (dynamic, symmetric; AVX512-VNNI dot products, as OpenVINO's CPU plugin does by
    default for compressed weights), 1.3-1.6x faster per layer at 1-16 rows. auto: int8 where the
    CPU and the C++ kernels have AVX512-VNNI, else bfloat16. int8 needs dtype bfloat16 on CPU and
    a CPU with AVX512-VNNI. A draft model (`speculative_config`) follows the same setting."""
    kv_cache_dtype: Literal["auto", "int8", "fp8"] = "auto"
    """KV-cache storage (vLLM's name): auto, the model's dtype; int8 or fp8 (float8_e4m3fn): 8-bit
    keys and values with a float32 scale per token and kv head (symmetric, max|x| / 127 or / 448
    over head_dim), quantized when stored, read in place by the attention kernels: about 2x the
    blocks of a bfloat16 cache in the same memory (4x float32). fp8 on CUDA needs compute
    capability 8.9 or newer."""
    kernel_backend: Literal["auto", "triton", "torch"] = "auto"
    """auto: Triton kernels on CUDA, PyTorch on CPU."""
    enforce_eager: bool = False
    """No CUDA graphs (vLLM's name). Otherwise decode steps on one CUDA rank with the Triton
    kernels replay a graph per batch-size bucket (execution/decode_graphs.py)."""
    cudagraph_capture_sizes: str = ""
    """The buckets (vLLM's name), comma-separated; "": vLLM's defaults up to max_num_seqs
    (cuda_graph_config.py)."""
    tensor_parallel_size: int = 1
    """Ranks the model is sharded over (Megatron-style, `execution/tensor_parallel.py`), one
    process each: the engine's process is rank 0 and starts the others (execution/workers.py)."""
    pipeline_parallel_size: int = 1
    """Stages the layers are split over (vLLM's name; `execution/pipeline_parallel.py`), each of
    `tensor_parallel_size` ranks: evenly, the remainder to the last stages. Stage 0 also holds the
    embedding and lm_head and samples; activations pass from stage to stage each step."""
    distributed_executor_backend: Literal["mp"] = "mp"
    """How the other ranks run (vLLM's name): mp, worker processes started by rank 0 on its node;
    on other nodes (`nnodes` > 1) by `python -m backend_lib.llm.execution.worker_node`."""
    nnodes: int = 1
    """Machines the ranks span (vLLM's name); each runs world_size / nnodes of them."""
    node_rank: int = 0
    """This machine's index among `nnodes` (vLLM's name). The Triton model is node 0, which holds
    rank 0; worker nodes pass theirs to the worker_node entry point (NODE_RANK)."""
    master_addr: str = "127.0.0.1"
    """Address of node 0, where the ranks meet (torch.distributed's env rendezvous); worker nodes
    take theirs from MASTER_ADDR."""
    master_port: int = 0
    """Port of the rendezvous on node 0; 0 picks a free one (one node only)."""
    max_model_len: int = 0
    """Longest prompt plus output, in tokens; 0 takes the checkpoint's max_position_embeddings."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    gpu_memory_utilization: float = 0.9
    """Share of GPU memory for weights, activations and the KV pool (CUDA only)."""
    cpu_kv_cache_gb: float = 1.0
    """KV pool size on CPU, in GiB."""
    num_blocks: int = 0
    """Exact KV pool size in blocks (overrides the memory-based sizing when > 0)."""
    swap_space: float = 1.0
    """Host-memory swap pool for preempted sequences, in GiB (used when preemption_mode=swap)."""
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_seqs: int = 64
    """Most sequences running in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks plus decodes)."""
    max_queue_size: int = 1024
    """Most requests waiting for admission; more are refused with a queue-full error."""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """The order requests are served in (vLLM's name and semantics, core/request_queue.py):
    first come first served, or by each request's `priority` (lower first, then arrival), the
    lowest priority preempted first."""
    max_queue_wait_ms: int = 0
    """Longest a request may wait for admission, in milliseconds; past it, it is answered with
    queue_timeout (HTTP 503 with Retry-After at the frontend, as SGLang's queue timeout). 0: no
    limit."""
    priority_aging_rate: float = 0.0
    """Starvation guard under `scheduling_policy: priority`, in priority levels per second of
    waiting: the effective priority is priority - rate * seconds since arrival. 0: strict order,
    as vLLM."""
    fair_share: bool = False
    """Share the engine between tenants (core/tenants.py): admission takes the tenant of least
    weighted tokens served first, and a tenant under its share of `max_num_seqs` may displace a
    sequence of the tenant furthest over its share. A tenant is the request's `tenant` (the
    frontend passes the API key's name or `user`), else its LoRA adapter, else "default"."""
    interruptible_steps: bool = True
    """Under priority or fair share, a step in flight yields at a layer boundary to an arrival
    that outranks its work (engine/step_interrupts.py; one rank, no speculation)."""
    tenant_weights: str = ""
    """A JSON file of tenant weights, `{"<tenant>": <weight > 0>, ...}` (relative to the model
    dir; "" or a tenant not listed: weight 1). Under `fair_share`, each tenant's share of tokens
    and slots is its weight over the weights of the tenants with requests."""
    max_running_per_tenant: int = 0
    """Most sequences of one tenant running at once; the tenant's further requests wait (0: no
    limit)."""
    max_queued_per_tenant: int = 0
    """Most requests of one tenant waiting for admission; more are refused with queue_full
    (HTTP 429 with Retry-After at the frontend). 0: no limit but max_queue_size."""
    max_tenant_labels: int = 16
    """Distinct tenants (and distinct priorities) that get a label of their own in the per-tenant
    and per-priority metrics; later ones are counted as `other`, so the series stay bounded."""
    seed: int = 0
    """Seed of the engine's default generator (requests without their own seed)."""
    max_prompt_bytes: int = 1 << 20
    """Largest accepted prompt, in UTF-8 bytes (a larger one is refused before tokenizing)."""
    max_n: int = 16
    """Largest `n` (parallel samples) a request may ask for (the request parser and the engine
    both check this value; neither has a cap of its own)."""
    max_logprobs: int = 20
    """Largest `logprobs` (top log-probabilities per token) a request may ask for (the request
    parser and the engine both check this value). At most the checkpoint's vocabulary size,
    checked when the engine loads."""
    structured_outputs_compile_timeout_s: float = 10.0
    """Most CPU seconds (not wall time: load delays, never fails, a compile) one structured_outputs
    constraint may take to compile in a niced worker; past it that request fails with an error
    naming the constraint and the compile is stopped (its worker killed)."""
    tool_call_parser: str | None = None
    """How the OpenAI frontend finds tool calls in this model's text for `tool_choice` "auto"
    (vLLM's `--tool-call-parser` names, `contract.TOOL_CALL_PARSERS`): hermes, llama3_json,
    mistral or qwen3_xml. None: no parser, and "auto" with tools is refused. Published in the
    model's facts; the engine itself never reads it."""
    reasoning_parser: str | None = None
    """How the OpenAI frontend splits this model's reasoning from its answer (vLLM's
    `--reasoning-parser` names, `contract.REASONING_PARSERS`): deepseek_r1 or qwen3 (`<think>`
    tags). None: the text is all content. Published in the model's facts."""

    speculative_config: str = ""
    """Speculative decoding (vLLM's name): a JSON object with vLLM's SpeculativeConfig fields, e.g.
    `{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}`; "" for none.
    Parsed and checked by `speculative_config.SpeculativeConfig` (errors name
    `speculative_config.<field>`); `speculative` is the parsed value."""

    kv_events_config: str = ""
    """KV cache events for cache-aware routing (vLLM's name): a JSON object with vLLM's
    KVEventsConfig fields, e.g. `{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557",
    "replay_endpoint": "tcp://*:5558"}`; "" for none. Parsed and checked by
    `kv_events_config.KVEventsConfig` (errors name `kv_events_config.<field>`)."""

    kv_offloading_backend: Literal["none", "native"] = "none"
    """The prefix cache's offload tier (vLLM's name; core/kv_offload.py): none, or native (blocks
    the KV pool evicts are kept in host memory and, with `kv_offloading_path`, on disk, and read
    back on a prefix hit instead of being recomputed). Needs enable_prefix_caching."""
    kv_offloading_size: float = 0.0
    """Host memory of the tier, in GiB (vLLM's name; the total over tensor-parallel ranks)."""
    kv_offloading_path: str = ""
    """A directory for the disk tier (relative to the model directory): one file per block and
    rank, checked when read, reused after a restart of the same model and cache layout. "": none."""
    kv_offloading_disk_size: float = 0.0
    """GiB of block files the disk tier keeps (least recently used removed first)."""

    enable_lora: bool = False
    """Serve the LoRA adapters listed in `<version>/multi_lora.json` (requests pick one with
    `lora_name` in sampling_parameters)."""
    max_loras: int = 1
    """Adapters resident on the device at once (distinct adapters in one step)."""
    max_lora_rank: int = 16
    """Largest adapter rank accepted; the device slots are sized for it."""
    max_cpu_loras: int = 0
    """Adapters cached in host memory (0: max_loras, as vLLM); at least max_loras."""

    # Images, checked in multimodal_config.py (vLLM's limit_mm_per_prompt, encoder_cache_size).
    limit_mm_per_prompt: str = ""
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    encoder_cache_size: int = 0

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config` parsed (None: no speculation)."""
        return SpeculativeConfig.from_json(self.speculative_config)

    @property
    def kv_events(self) -> KVEventsConfig:
        """`kv_events_config` parsed."""
        return KVEventsConfig.from_json(self.kv_events_config)

    @property
    def capture_sizes(self) -> tuple[int, ...]:
        """`cudagraph_capture_sizes` parsed, ascending (the default sizes for "")."""
        return cuda_graph_config.capture_sizes(self.cudagraph_capture_sizes, self.max_num_seqs)

    @property
    def world_size(self) -> int:
        """Ranks of the engine: tensor_parallel_size x pipeline_parallel_size, one process each."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def validate(self) -> None:
        MultiModalConfig.of(self)  # the image settings: parsing is the check
        self.capture_sizes  # noqa: B018 (parsing is the check)
        require(
            self.tensor_parallel_size >= 1,
            "tensor_parallel_size",
            self.tensor_parallel_size,
            "must be >= 1",
        )
        require(
            self.pipeline_parallel_size >= 1,
            "pipeline_parallel_size",
            self.pipeline_parallel_size,
            "must be >= 1",
        )
        require(
            self.distributed_executor_backend == "mp",
            "distributed_executor_backend",
            self.distributed_executor_backend,
            "expected mp",
        )
        require(
            self.nnodes >= 1 and self.world_size % self.nnodes == 0,
            "nnodes",
            self.nnodes,
            f"must be >= 1 and divide the world size, tensor_parallel_size x "
            f"pipeline_parallel_size ({self.world_size})",
        )
        require(
            0 <= self.node_rank < self.nnodes, "node_rank", self.node_rank, "must be in [0, nnodes)"
        )
        require(
            self.nnodes == 1 or self.master_port > 0,
            "master_port",
            self.master_port,
            "must be set (> 0) when nnodes > 1: the worker nodes need to know it",
        )
        require(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            "dtype",
            self.dtype,
            "expected one of auto, float32, bfloat16, float16",
        )
        require(
            self.quantization in QUANTIZATION_SETTINGS,
            "quantization",
            self.quantization,
            f"expected one of {', '.join(QUANTIZATION_SETTINGS)}",
        )
        require(
            self.w4a16_activations in W4A16_ACTIVATIONS,
            "w4a16_activations",
            self.w4a16_activations,
            f"expected one of {', '.join(W4A16_ACTIVATIONS)}",
        )
        require(
            self.kv_cache_dtype in ("auto", "int8", "fp8"),
            "kv_cache_dtype",
            self.kv_cache_dtype,
            "expected one of auto, int8, fp8",
        )
        require(self.max_model_len >= 0, "max_model_len", self.max_model_len, "must be >= 0")
        require(
            self.block_size in (8, 16, 32, 64, 128),
            "block_size",
            self.block_size,
            "expected one of 8, 16, 32, 64, 128",
        )
        require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            self.gpu_memory_utilization,
            "must be in (0, 1]",
        )
        require(self.cpu_kv_cache_gb > 0, "cpu_kv_cache_gb", self.cpu_kv_cache_gb, "must be > 0")
        require(self.num_blocks >= 0, "num_blocks", self.num_blocks, "must be >= 0")
        require(self.swap_space >= 0, "swap_space", self.swap_space, "must be >= 0")
        require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be >= 1")
        require(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            "must be >= 1",
        )
        SpeculativeConfig.from_json(self.speculative_config)  # a bad value fails the load
        KVEventsConfig.from_json(self.kv_events_config)
        kv_offload_config.validate(self)
        require(self.max_queue_size >= 1, "max_queue_size", self.max_queue_size, "must be >= 1")
        require(
            self.max_queue_wait_ms >= 0, "max_queue_wait_ms", self.max_queue_wait_ms, "must be >= 0"
        )
        require(
            self.priority_aging_rate >= 0,
            "priority_aging_rate",
            self.priority_aging_rate,
            "must be >= 0",
        )
        require(
            self.fair_share or not self.tenant_weights,
            "tenant_weights",
            self.tenant_weights,
            "weights apply under fair_share, which is off",
        )
        for key in ("max_running_per_tenant", "max_queued_per_tenant"):
            require(getattr(self, key) >= 0, key, getattr(self, key), "must be >= 0 (0: no limit)")
        require(
            self.max_tenant_labels >= 1, "max_tenant_labels", self.max_tenant_labels, "must be >= 1"
        )
        require(
            self.max_prompt_bytes >= 1, "max_prompt_bytes", self.max_prompt_bytes, "must be >= 1"
        )
        require(self.max_n >= 1, "max_n", self.max_n, "must be >= 1")
        require(self.max_logprobs >= 0, "max_logprobs", self.max_logprobs, "must be >= 0")
        require(
            self.structured_outputs_compile_timeout_s > 0,
            "structured_outputs_compile_timeout_s",
            self.structured_outputs_compile_timeout_s,
            "must be > 0",
        )
        for key, names in (
            ("tool_call_parser", contract.TOOL_CALL_PARSERS),
            ("reasoning_parser", contract.REASONING_PARSERS),
        ):
            value = getattr(self, key)
            require(
                value is None or value in names,
                key,
                value,
                f"expected one of {', '.join(names)} (or none)",
            )
        require(
            self.preemption_mode != "swap" or self.swap_space > 0,
            "swap_space",
            self.swap_space,
            "must be > 0 when preemption_mode=swap",
        )
        _check_lora_settings(self)
        if not self.enable_chunked_prefill and self.max_model_len:
            require(
                self.max_num_batched_tokens >= self.max_model_len,
                "max_num_batched_tokens",
                self.max_num_batched_tokens,
                f"must be >= max_model_len ({self.max_model_len}) without chunked prefill",
            )

    @property
    def cpu_lora_capacity(self) -> int:
        """Adapters kept loaded in host memory (max_cpu_loras, 0 meaning max_loras)."""
        return self.max_cpu_loras or self.max_loras


def _check_lora_settings(config: LLMConfig) -> None:
    require(config.max_loras >= 1, "max_loras", config.max_loras, "must be >= 1")
    require(
        1 <= config.max_lora_rank <= 512,
        "max_lora_rank",
        config.max_lora_rank,
        "must be in [1, 512]",
    )
    require(
        config.max_cpu_loras == 0 or config.max_cpu_loras >= config.max_loras,
        "max_cpu_loras",
        config.max_cpu_loras,
        f"must be 0 (= max_loras) or >= max_loras ({config.max_loras})",
    )
