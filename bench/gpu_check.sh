#!/usr/bin/env bash
# The prepared GPU check (bench/gpu_check.py): Triton kernels and the engine exact against
# Hugging Face on a real CUDA device, and bf16 decode tokens/s at batch 1, 32 and 256 against the
# device's memory roofline. Under 8 minutes on one GPU (about 5 on an H200).
#
# The GPU machine has torch, Triton and transformers but no package registry, so what else
# pagedq needs travels beside the repo. Here, where PyPI and the default model are reachable:
#   bash bench/gpu_check.sh fetch    # wheels into .whl/, the default tokenizer into .gpu_check/
# then, on the GPU machine, from the repo root (carrying .whl and .gpu_check):
#   bash bench/gpu_check.sh          # installs the wheels into /tmp/site, runs the check
# Both folders are git-ignored; together about 12 MiB. Extra arguments go to gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# pagedq's runtime dependencies that a CUDA image with torch/Triton/transformers usually lacks.
WHEELS=(redis rq click croniter python-dateutil pydantic pydantic-core annotated-types
        typing-inspection structlog llguidance gguf)

if [[ "${1:-}" == "fetch" ]]; then
  shift
  mkdir -p .whl
  rm -f .whl/*.whl
  for name in "${WHEELS[@]}"; do  # the versions this venv runs
    version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))")
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 \
      --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$name==$version"
  done
  .venv/bin/python bench/gpu_check.py --parts tokenizer --device cpu
  du -sh .whl .gpu_check
  exit 0
fi

if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 470 $PY bench/gpu_check.py "$@"
