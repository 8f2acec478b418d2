"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter.

TRITON_INTERPRET is read when a kernel is decorated, i.e. when a ``kernels.triton_*`` module is
imported; ``kernels/__init__`` imports those lazily, so setting it here is enough as long as no
test folder collected earlier imported one (checked below). The variable only affects Triton.
"""

import os

_preset = "TRITON_INTERPRET" in os.environ
os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402
import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

_early = [name for name in sys.modules if name.startswith("kernels.triton_")]
if _early and not _preset:
    # The interpreter cannot take over kernels already compiled-for-GPU at import.
    raise pytest.UsageError(
        f"{_early} were imported before tests/kernels/conftest.py set TRITON_INTERPRET=1; "
        "set it in tests/conftest.py instead (or in the environment)"
    )


@pytest.fixture
def rng(request) -> torch.Generator:
    """A generator seeded from the test's id: fresh inputs per case, reproducible per case."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
