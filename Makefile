# Two commands for a newcomer: `make train` runs the main job, `make test` runs every check.
# Both set up a venv first (once), installing through constraints.txt (torch 2.13.0, the oldest
# tested).

PYTHON ?= python3
# Another Python gets a venv of its own beside .venv: `make test PYTHON=python3.13` sets up and
# tests .venv-python3.13 (scripts/find_python.sh finds python3.13 on PATH, else in pyenv).
# CONSTRAINTS=constraints-newest.txt takes the newest torch tested; PIP_ARGS passes options to
# pip, such as PyTorch's CPU index on a machine without a GPU (README, "Quick start"): a
# PIP_ARGS other than the one a venv was set up with sets that venv up again, from scratch,
# since pip keeps an installed torch that satisfies the pins whatever index it came from.
VENV ?= $(if $(filter python3,$(PYTHON)),.venv,.venv-$(notdir $(PYTHON)))
CONSTRAINTS ?= constraints.txt
PIP_ARGS ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP_ARGS_FILE := $(VENV)/.pip-args

.PHONY: setup train explain test test-newest lint docs bench bench-gpu readme-figures check-bare clean

setup: $(STAMP)

ifneq ($(strip $(PIP_ARGS)),)
ifneq ($(strip $(PIP_ARGS)),$(strip $(shell cat $(PIP_ARGS_FILE) 2>/dev/null)))
$(STAMP): pip-args-changed
endif
endif

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@if [ -n '$(strip $(PIP_ARGS))' ] && [ -d $(VENV) ] && \
	  [ '$(strip $(PIP_ARGS))' != "$$(cat $(PIP_ARGS_FILE) 2>/dev/null)" ]; then \
	  echo "PIP_ARGS differs from $(VENV)'s: setting it up again"; rm -rf $(VENV); fi
	py=$$(scripts/find_python.sh '$(PYTHON)') && "$$py" -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(PIP_ARGS) -c $(CONSTRAINTS) -e '.[dev,plot]'
	$(if $(strip $(PIP_ARGS)),printf '%s\n' '$(strip $(PIP_ARGS))' > $(PIP_ARGS_FILE))
	touch $(STAMP)

.PHONY: pip-args-changed
pip-args-changed:

train: $(STAMP)
	$(BIN)/dataparallel train $(ARGS)

explain: $(STAMP)
	$(BIN)/dataparallel explain $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Every run says what it ran on: CI runs several (.ci/run). The suite runs on TEST_WORKERS
# processes at once (pytest-xdist): each file not marked `slow` is a unit of work, its tests
# together and in order on one worker; the `slow` tests (real processes, end-to-end commands,
# limits in seconds) run in three chains, each one test at a time on a worker of its own
# (tests/conftest.py, SLOW_CHAINS), started first since they are the longest. Each worker, and
# each process a test starts, computes on TEST_THREADS threads (OMP_NUM_THREADS): the workers
# already fill the cores, and torch's default of one thread per core in each of them made the
# suite a fifth slower on 2 cores (tests/programs and tests/wrapper: 90 to 101 s against 71 to
# 78 s). TEST_THREADS= keeps torch's default.
TEST_WORKERS ?= 5
TEST_THREADS ?= 1
test: lint
	$(BIN)/python -c "$$VERSIONS"
	$(if $(TEST_THREADS),OMP_NUM_THREADS=$(TEST_THREADS) )$(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(ARGS)

# The API reference, the guide and the benchmarks page as HTML in docs/_build/html (open
# index.html): Sphinx installed into the venv on first use (the `docs` extra), warnings as
# errors, every cross-reference checked (-n).
DOCS_STAMP := $(VENV)/.installed-docs

$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet $(PIP_ARGS) -c $(CONSTRAINTS) -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(BIN)/python -m sphinx -E -W --keep-going -n -q -b html docs docs/_build/html
	@echo "docs: docs/_build/html/index.html"

export VERSIONS := import sys, torch, transformers; print(f"testing on Python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")

# The same checks on the newest torch the registry serves (constraints-newest.txt), in a second
# venv: pyproject.toml declares the oldest torch tested (`make test`), this is the newest.
test-newest:
	$(MAKE) test VENV=.venv-newest CONSTRAINTS=constraints-newest.txt

bench: $(STAMP)
	$(BIN)/python -m benchmarks $(ARGS)

# Run the default training (and on two CPU replicas), keep the figures in benchmarks/results/,
# and rewrite the marked figures of README.md and docs/ from them and from
# benchmarks/results/latest-cpu.json.
# It refuses a busy machine (load average, CPU taken by others); ARGS=--allow-busy writes anyway,
# with the load beside the figures.
readme-figures: $(STAMP)
	$(BIN)/python scripts/readme_figures.py --run $(ARGS)

# A bare install (the wheel, no extras, offline) tries every command of the CLI.
check-bare: $(STAMP)
	$(BIN)/python scripts/bare_install.py

# The GPU set (benchmarks/bench_gpu.py); without CUDA it says so and exits 0.
bench-gpu: $(STAMP)
	$(BIN)/python benchmarks/bench_gpu.py $(ARGS)

clean:
	rm -rf .venv .venv-* docs/_build .pytest_cache .mypy_cache .ruff_cache .hypothesis
