# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
REPO ?= model_repository
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?= 9000
PYTEST_ARGS ?=

.PHONY: setup prometheus serve test test-all test-fast lint format bench gpu-check clean

CPU_KERNELS := .cache/kernels/llm_cpu.so
setup: $(STAMP) prometheus $(CPU_KERNELS)

$(STAMP): requirements.txt constraints.txt pyproject.toml scripts/tritonserver
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt -c constraints.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	ln -sf ../../scripts/tritonserver $(VENV)/bin/tritonserver
	touch $(STAMP)

# The C++ CPU kernels (kernels/csrc/), rebuilt when a source changes. Without a compiler nothing is
# built (one line says so), setup still succeeds and the PyTorch paths serve; the target is then
# retried on the next setup.
$(CPU_KERNELS): $(STAMP) $(wildcard kernels/csrc/*.cpp kernels/csrc/*.h) kernels/cpu_extension.py kernels/cpu_build.py
	$(PY) -m kernels.cpu_build

# Debian's Prometheus server and promtool: the deployment tests (tests/deploy) run a real Prometheus
# against a real tritonserver and unit-test the alerts. Installed with apt-get when missing.
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || { \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  echo "installing Debian's prometheus package"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  $$sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 || \
	    { $$sudo apt-get update -qq && $$sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }; \
	  command -v promtool >/dev/null || { echo "could not install prometheus (apt-get as root or with sudo)"; exit 1; }; }

serve: setup
	@$(PY) scripts/serve.py --model-repository=$(REPO) --http-port=$(HTTP_PORT) --grpc-port=$(GRPC_PORT) --metrics-port=$(METRICS_PORT) --openai-port=$(OPENAI_PORT)

# Lint, unit and kernel tests, end-to-end tests against a real tritonserver, the benchmark suite
# in --quick mode: every test but those marked slow, i.e. the parametrizations an expensive test's
# @pytest.mark.sample(n) leaves out (tests/sampling.py). Two pytest workers (one per core): tests
# sharing a server or the benchmark run stay on one worker (tests/conftest.py: worker_group);
# TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS))
test: setup lint
	$(PY) -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

# As make test, with every parametrization: the slow tests too.
test-all: setup lint
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

# The inner loop: unit and kernel tests only, no tritonserver, no benchmarks.
test-fast: setup
	$(PY) -m pytest $(XDIST) -m "not e2e and not bench and not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The benchmark suite: bench/results/{*.json,summary.json,report.md,*.png}, and README.md's headline table
# (bench.headline). It prints each benchmark's seconds and its own total; the last full run's are in
# bench/results/summary.json ("seconds") and report.md. Budget: 70 min on 2 cores (real_sizes ~21 of them);
# the peers' .venv-peers (llama.cpp built from source, ~7 min) and real_sizes' 1B models (~30 GB under
# .cache/real-sizes, ~5 min) are built on first use.
# BENCH_ARGS=--gpu for the GPU mode, BENCH_ARGS="--only engine,prefix_cache" for a subset.
BENCH_ARGS ?=
bench: setup
	$(PY) -m bench $(BENCH_ARGS)

# What only a CUDA GPU can check (kernels on CUDA, the engine vs transformers on CUDA, a short GPU
# bench), at most 8 minutes, one JSON summary (gpu_check.json); without a GPU it says so and
# exits 0. docs/testing.md.
gpu-check: setup
	$(PY) -m tooling.gpu_check $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .venv-peers .cache/bench-peers .cache/kernels .pytest_cache .ruff_cache
