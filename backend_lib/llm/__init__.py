"""The LLM engine behind the `llm` model: continuous batching over a paged KV cache.

config.py                 LLMConfig: every engine setting, from config.pbtxt parameters.
speculative_config.py     SpeculativeConfig: the speculative_config parameter, parsed.
kv_events_config.py       KVEventsConfig: the kv_events_config parameter, parsed.
kv_offload_config.py      KVOffloadConfig: the kv_offloading_* settings, checked and resolved.
serving/                  Between Triton and the engine (the only layer that knows Triton tensors):
  service.py              LLMService: parse, submit, build response tensors; Responder thread.
  triton_request.py       Request tensors -> GenerateRequest (prompt, SamplingParams, flags).
  engine_loop.py          EngineLoop: the thread that alone drives the engine; OutputStream.
  kv_event_publisher.py   KV events published over ZeroMQ (PUB, and a ROUTER for replays).
  metrics.py              LLMMetrics: vLLM-named gauges, counters, histograms from EngineStats.
  tenant_metrics.py       Per-tenant and per-priority series (llm_tenant_*, llm_priority_*).
  offload_metrics.py      The offload tier's series (vllm:external_prefix_cache_*, llm_kv_offload_*).
engine/                   Above core/ and execution/ (as vLLM v1's engine/ above its core):
  llm_engine.py           LLMEngine: step() = schedule -> execute -> update -> process outputs.
  drafter.py              Drafter: who speculates, their drafts before scheduling, verification.
  offline.py              generate(): prompts queued all or nothing, stepped to completion.
  input_processor.py      InputProcessor: validation, tokenization, adapter and grammar
                          resolution -> PreparedRequest (on the caller's thread).
  output_processor.py     OutputProcessor: per-request state, detokenizer, stop strings,
                          RequestOutputs, finishing and failing requests.
  detokenizer.py          IncrementalDetokenizer: streamed text deltas, stop strings.
  parallel_sampling.py    n > 1: one prefill, then forked child sequences.
  grammar_step.py         Advancing each constrained sequence's grammar after a step.
  grammar_wait.py         Requests held outside the scheduler while their grammar compiles.
  offload_steps.py        The offload tier per step: its index, its threads' reports, its stats.
  fault_injection.py      The one TEST-ONLY seam for injecting per-request faults.
core/                     Scheduling state, device-independent (imports no engine/execution):
  request.py              EngineRequest: the request as it enters the engine (one typed seam).
  scheduler.py            Scheduler: admission, chunked prefill, preemption, token-level stops.
  stop_checker.py         StopChecker: EOS, stop token ids, max_tokens, max_model_len.
  kv_cache_manager.py     KVCacheManager: block tables, prefix-cache lookup, copy-on-write, swap.
  block_pool.py           BlockPool: ref-counted KV block ids, LRU free queue, prefix hashes.
  kv_offload.py           KVOffloader: which block hashes RAM and disk hold; each step's copies.
  kv_events.py            KVEventLog: the prefix cache's stores and evictions as vLLM's events.
  sequence.py             Sequence: one generated sequence's tokens and state.
  sampling_params.py      SamplingParams: vLLM's fields, defaults and validation.
  outputs.py              RequestOutput, CompletionOutput: what a step hands back.
  stats.py                StatsCollector -> EngineStats snapshots for the metrics.
spec_decode/              Speculation's maths, below the engine: n-gram and draft-model
                          proposers, the verifier and its rejection sampler.
execution/                What runs on the device:
  model_runner.py         ModelRunner: block moves, the step's forward, prompt logprobs.
  step_batch.py           StepBatcher: a scheduled step -> one flattened ModelInput.
  step_sampling.py        A step's logits -> ModelOutput: bitmasks, plain rows sampled.
  kv_sizing.py            How many KV blocks the runner allocates (profiled on CUDA).
  runner_lora.py          The runner's LoRA adapter spec and device slots.
  loader.py               Checkpoint facts and weights -> a registered model class.
  models/llama.py         The Llama family (Llama, Mistral, Qwen2, Qwen3): one forward, its
                          per-layer calls bound once at load, for every kernel set.
  models/step_kernels.py  A step's kernel binding: straight C++ op calls or the KernelOps wrappers.
  attention.py            AttentionMetadata and the kernel set of a device.
  kernel_backend.py       The kernel_backend setting -> "triton" or "torch" kernels.
  kv_pool.py              KVPool: the preallocated K/V tensor, its sizing, swaps and copies.
  kv_offload_store.py     OffloadStore: the tier's RAM slots, its copies, disk writer and reader.
  kv_tier_files.py        BlockFiles: one checked file per block, size-bounded, with a manifest.
  sampler.py              Sampler: penalties, temperature, top-k/p, min-p, seeds, logprobs.
lora/                     LoRA adapters: loading, device slots, per-row batches.
structured/               Structured outputs: params, grammar compiler (worker processes),
                          matchers, bitmasks.

A request's path: model.py hands the request tensors to `LLMService.start`, which parses them
(`parse_generate_request`) and submits an `EngineRequest` to the `EngineLoop`; the engine's
`InputProcessor` validates and tokenizes it on Triton's thread. The loop thread adds the request to the engine and
calls `LLMEngine.step()` while requests are unfinished: `Scheduler.schedule` picks the step's
sequences and their KV blocks, `ModelRunner.execute` runs the model (attention through
`kernels/`) and samples, `Scheduler.update` appends the tokens and applies stops, the
`OutputProcessor` turns tokens into text, and each request with news gets a `RequestOutput` on its
`OutputStream`. The service's responder thread turns those into response tensors and sends them;
after every step `LLMMetrics.update` records the engine's stats.
"""
