"""The benchmark suite: LLM engine, batching, prefix cache, KV memory, preemption, serving through
tritonserver, embedding and rerank, each against a reference (transformers, sentence-transformers,
the engine in-process), plus the Triton kernel micro-benchmarks. Results: bench/results/.

    python -m bench [--quick] [--gpu] [--only engine,prefix_cache]   # the suite (`make bench`)
    python -m bench.<name> [--quick] [--out PATH] ...                  # one benchmark alone
    python -m bench.kernels --tiny --out /tmp/kernels.json             # kernels (GPU; CPU: --tiny)

Every benchmark module declares one `Benchmark` (bench.skeleton: its flags, run, report section
and plots; the command line they share is bench.cli) and checks that the compared systems give
the same outputs before it times them, interleaved.
"""
