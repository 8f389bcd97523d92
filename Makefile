# `make demo` and `make test` do all set-up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH ?= torch==2.13.0
DEMO_OUT ?= runs/demo

.PHONY: demo test lint install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned: a range would pull a multi-GB CUDA build on CPU machines.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# the embedded default: coordinator, learner and 2 samplers as processes on 127.0.0.1, tiny offline model
demo: $(STAMP)
	$(BIN)/heterorl local --samplers 2 --out $(DEMO_OUT)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache
