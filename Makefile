# `make demo` and `make test` both create .venv and install hybridpar into it first.
# TORCH pins the torch wheel: the default takes the local CPU wheel on a fresh machine here and
# never downloads CUDA packages; a GPU user overrides it, e.g. `make test TORCH=torch`.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint format install clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/pip install -q --disable-pip-version-check -e ".[dev]"
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/hybridpar plan --model alexnet --procs 512 --batch 2048 --cluster cori-knl
	$(BIN)/hybridpar train --report runs/demo.json

test: install
	$(BIN)/pytest -q

lint: install
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: install
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
