"""The gated delta, conv1d and latent attention Triton kernels compile for sm80 and sm90 (to a
cubin), not only interpreted: the interpreter never runs Triton's compiler. The compiler runs in
a child process, since this one has TRITON_INTERPRET set."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("compile_cuda_hybrid.py")


def test_hybrid_kernels_compile_for_cuda():
    nvidia = pytest.importorskip("triton.backends.nvidia.compiler")
    try:
        nvidia.get_ptxas(80)  # shipped inside the triton wheel on x86-64 Linux
    except Exception as e:
        pytest.skip(f"Triton's NVIDIA toolchain (ptxas) is unavailable: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 5 * 3
    failures = {r["case"]: r["error"] for r in results if r["error"]}
    assert not failures, json.dumps(failures, indent=1)
