"""The GEMM's users compile for every x86 path they have, not only for this host's.

``kernels/csrc`` takes a different path per instruction set (AVX2, AVX-512, AVX512-BF16, AMX),
and the library is built with ``-march=native``: a change that breaks another path's build
passes every test here and then leaves a host of that kind with no C++ kernels at all (one did:
an AVX-512 host without AMX). Each file is checked with ``-fsyntax-only`` (templates included)
for one CPU of each path.
"""

from __future__ import annotations

import platform
import subprocess
import sysconfig

import pytest
from torch.utils import cpp_extension

from engine.cpu_features import cpu_flags
from kernels.cpu_attention import CSRC, _compiler

# A CPU of each path: AVX2 (Zen 2/3), AVX-512 without BF16 or AMX (Skylake-SP), AMX.
TARGETS = {"avx2": "x86-64-v3", "avx512": "skylake-avx512", "amx": "sapphirerapids"}
FILES = ("moe_cpu.cpp", "linear_cpu.cpp")


def native_path() -> str:
    """This host's path, which the library's own build (-march=native) already compiles."""
    flags = cpu_flags()
    return "amx" if "amx_tile" in flags else "avx512" if "avx512f" in flags else "avx2"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 targets")
@pytest.mark.skipif(_compiler() is None, reason="no C++ compiler")
def test_the_gemm_users_compile_for_every_x86_path():
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    base = [_compiler(), "-std=c++20", "-fopenmp", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=t"]
    base += [f"-I{path}" for path in includes]
    targets = [march for path, march in TARGETS.items() if path != native_path()]
    jobs = [(t, f) for t in targets for f in FILES]
    failures = []
    for i in range(0, len(jobs), 2):  # two at a time: the machine has two cores
        running = [
            (
                job,
                subprocess.Popen(
                    [*base, f"-march={job[0]}", str(CSRC / job[1])],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                ),
            )
            for job in jobs[i : i + 2]
        ]
        for job, proc in running:
            out, _ = proc.communicate(timeout=300)
            if proc.returncode:
                failures.append(f"{job[1]} -march={job[0]}:\n{out[-2000:]}")
    assert not failures, "\n".join(failures)
