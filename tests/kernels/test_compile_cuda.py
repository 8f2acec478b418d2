"""Every kernel compiles for real NVIDIA targets (sm80, sm90; to a cubin), not only interpreted.

The interpreter bypasses Triton's compiler and never runs the ``INTERPRET=False`` branches, so
this is what catches code that only the GPU front end or backend would reject. The compiler runs
in a child process, since this one has TRITON_INTERPRET set.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("compile_cuda.py")


@pytest.fixture(scope="module")
def compile_results() -> dict[str, str | None]:
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
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return {line["case"]: line["error"] for line in lines}


def test_every_kernel_compiles_for_cuda(compile_results):
    assert len(compile_results) == 9 * 3
    failures = {case: error for case, error in compile_results.items() if error}
    assert not failures, json.dumps(failures, indent=1)
