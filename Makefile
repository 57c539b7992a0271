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

.PHONY: setup serve test test-fast lint format bench clean

setup: $(STAMP)

$(STAMP): requirements.txt constraints.txt pyproject.toml scripts/tritonserver
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt -c constraints.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	ln -sf ../../scripts/tritonserver $(VENV)/bin/tritonserver
	touch $(STAMP)

serve: setup
	@$(PY) scripts/serve.py --model-repository=$(REPO) --http-port=$(HTTP_PORT) --grpc-port=$(GRPC_PORT) --metrics-port=$(METRICS_PORT) --openai-port=$(OPENAI_PORT)

# Everything: lint, unit and kernel tests, end-to-end tests against a real tritonserver, the
# benchmark suite in --quick mode. Two pytest workers (one per core): tests sharing a server or
# the benchmark run stay on one worker (tests/conftest.py: worker_group); TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS))
test: setup lint
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

# The benchmark suite (<= 20 min on 2 cores): bench/results/{*.json,summary.json,report.md,*.png}.
# BENCH_ARGS=--gpu for the GPU mode, BENCH_ARGS="--only engine,prefix_cache" for a subset.
BENCH_ARGS ?=
bench: setup
	$(PY) -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
