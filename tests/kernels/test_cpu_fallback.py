"""Without a compiler, "auto" warns once and the torch reference serves the CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import select_backend
from kernels.cpu_attention import cpu_kernels_available

ROOT = Path(__file__).resolve().parents[2]

# Runs in a fresh process: no compiler (CXX points nowhere) and an empty kernel cache, so the
# library can be neither loaded nor built.
NO_COMPILER = r"""
import json, warnings
import torch
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from kernels import select_backend, unified_attention
    from kernels.reference import unified_attention_torch
    chosen = [select_backend("cpu"), select_backend("cpu", "auto")]
    q = torch.randn(5, 4, 64)
    kv = torch.randn(2, 4, 16, 2, 64)
    args = (q, kv, torch.tensor([0, 1, 5]), torch.tensor([9, 20]), torch.tensor([[0, -1], [1, 2]]),
            0.125)
    same = torch.equal(unified_attention(*args), unified_attention_torch(*args))
try:
    select_backend("cpu", "cpu")
    explicit = "accepted"
except RuntimeError as exc:
    explicit = str(exc)
print(json.dumps({"chosen": chosen, "same": same, "explicit": explicit,
                  "warnings": [str(w.message) for w in caught
                               if issubclass(w.category, RuntimeWarning)]}))
"""


def test_auto_picks_the_cpu_kernels_when_a_compiler_exists():
    if not cpu_kernels_available():
        pytest.skip("no compiler on this machine")
    assert select_backend("cpu") == "cpu"
    assert select_backend("cpu", "torch") == "torch"
    assert select_backend("cuda") == "triton"


def test_without_a_compiler_auto_warns_once_and_uses_the_reference(tmp_path):
    env = dict(os.environ, CXX=str(tmp_path / "no-such-g++"), PAGEDQ_KERNEL_CACHE=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", NO_COMPILER], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["chosen"] == ["torch", "torch"]
    assert result["same"] is True
    assert len(result["warnings"]) == 1
    assert "no C++ compiler found" in result["warnings"][0]
    assert "attention_backend='cpu' is unavailable" in result["explicit"]
    assert list(tmp_path.iterdir()) == []  # nothing was built


def test_pagedq_cpu_kernels_0_turns_them_off(tmp_path):
    env = dict(os.environ, PAGEDQ_CPU_KERNELS="0")
    code = "import warnings; warnings.simplefilter('ignore'); from kernels import select_backend; "
    code += "print(select_backend('cpu'))"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "torch"
