# Two commands on a fresh machine with Python 3.11+:
#   make lab    set everything up and open the course in JupyterLab
#   make test   set everything up and run the whole test suite
# PYTHON picks the interpreter, VENV where it is set up, PYTEST_ARGS what `make test` runs
# (.ci/run uses them for its second end: `make test PYTHON=python3.13 VENV=... PYTEST_ARGS=...`).
PYTHON ?= python3
VENV   ?= .venv
PYTEST_ARGS ?=
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup lab test tour bench course lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

lab: setup
	$(BIN)/python -m parallelkit lab

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

tour: setup
	$(BIN)/python -m parallelkit tour

bench: setup
	$(BIN)/python -m parallelkit bench
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/strategies.py
	$(BIN)/python benchmarks/cpu_pool.py
	$(BIN)/python benchmarks/dashboard.py
	$(BIN)/python benchmarks/prefetch.py
	$(BIN)/python benchmarks/layouts.py
	$(BIN)/python benchmarks/central.py
	$(BIN)/python benchmarks/experts.py
	$(BIN)/python benchmarks/roofline.py
	$(BIN)/python benchmarks/context.py
	$(BIN)/python benchmarks/precision.py
	$(BIN)/python benchmarks/planner.py
	$(BIN)/python benchmarks/buckets.py
	$(BIN)/python benchmarks/pipeline.py
	$(BIN)/python benchmarks/recompute.py

course: setup
	$(BIN)/python -m parallelkit course --out build/course

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
