"""A tensor-parallel worker that fails at start, as one out of memory would (the load-failure
test runs it in place of backend_lib.llm.execution.worker)."""

import sys

if __name__ == "__main__":
    print("RuntimeError: out of memory while loading rank 1's shard", file=sys.stderr)
    sys.exit(1)
