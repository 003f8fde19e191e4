# The two commands of the README: `make run` (quick start) and `make test` (default test suite).
# Both install first; install is idempotent and returns in seconds when nothing changed.
VENV   ?= .venv
PY     := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export OMP_NUM_THREADS ?= 1
export DS_ACCELERATOR ?= cpu
export VLLM_TARGET_DEVICE ?= cpu
export RAY_USAGE_STATS_ENABLED := 0
export PYTHONWARNINGS ?= ignore::DeprecationWarning
CONFIG ?= configs/quickstart.yaml
PYTEST_ARGS ?=
# `make test` runs its test files on this many pytest-xdist workers (one file per worker at a time:
# a file's module-scoped Ray cluster stays in one process); 0 runs them in this process, one by one.
TEST_WORKERS ?= 2

.PHONY: install run test test-all lint bench bench-trl clean

install:
	@bash scripts/install.sh

run: install
	$(PY) -m asyncrl.launch --config $(CONFIG) $(ARGS)

test: install
	$(PY) -m pytest -m "not slow and not gpu" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-all: install
	$(PY) -m pytest -m "not gpu" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check asyncrl tests scripts analysis

# ARGS: config overrides and the scenario's flags, e.g.
#   make bench SCENARIO=convergence ARGS="--staleness 0,4 --seeds 1 --reuse verifier.port=0"
bench: install
	$(PY) -m asyncrl.bench $(or $(SCENARIO),buffer) --config $(CONFIG) $(ARGS)

# asyncrl vs TRL's GRPOTrainer on the quick start's task (installs the optional `bench` extra: trl).
bench-trl: install
	$(PY) -m pip install -q -c requirements/constraints.txt -e ".[bench]"
	$(PY) -m asyncrl.bench trl --config $(CONFIG) $(ARGS)

clean:
	rm -rf runs bench .pytest_cache
