# Two commands for a newcomer: `make train` runs the main job, `make test` runs every check.
# Both set up .venv first (once), installing through constraints.txt so torch resolves to the
# pinned CPU build on machines without a GPU.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup train explain test test-newest lint bench bench-gpu readme-figures check-bare clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,plot]'
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/dataparallel train $(ARGS)

explain: $(STAMP)
	$(BIN)/dataparallel explain $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q $(ARGS)

# The same suite on the newest torch the registry serves (constraints-newest.txt), in a second
# venv: pyproject.toml declares the oldest torch tested (`make test`), this is the newest.
NEWEST := .venv-newest
NEWEST_STAMP := $(NEWEST)/.installed

$(NEWEST_STAMP): pyproject.toml constraints-newest.txt
	$(PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install --quiet --upgrade pip
	$(NEWEST)/bin/python -m pip install --quiet -c constraints-newest.txt -e '.[dev,plot]'
	touch $(NEWEST_STAMP)

test-newest: $(NEWEST_STAMP)
	$(NEWEST)/bin/python -c "import torch; print('make test-newest on torch', torch.__version__)"
	$(NEWEST)/bin/mypy
	$(NEWEST)/bin/python -m pytest -q $(ARGS)

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
	rm -rf $(VENV) $(NEWEST) .pytest_cache .mypy_cache .ruff_cache .hypothesis
