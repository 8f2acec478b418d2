"""Large CPU buffers backed by transparent huge pages (Linux), for the paged KV cache.

A decode reads each request's K/V as 4 KiB runs (one block of one head) scattered over a pool
of gigabytes: with 4 KiB pages nearly every run is a TLB miss and a page walk. Asking the kernel
for 2 MiB pages (``madvise(MADV_HUGEPAGE)``; the usual THP setting is ``madvise``, so plain
allocations never get them) made the C++ decode attention 0.89x the time on a 2-core EPYC
(docs/PERFORMANCE.md). ``PAGEDQ_HUGE_PAGES=0`` turns it off; elsewhere than Linux, or where the
call fails, the buffer is simply an ordinary one.
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask for huge pages under ``tensor``'s whole 2 MiB pages; True if the kernel agreed.

    Call it before the memory is first touched: pages already faulted in stay small.
    """
    if _MADVISE is None or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return last > first and _MADVISE(first, last - first, MADV_HUGEPAGE) == 0


def zeros_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype)`` on the CPU, on huge pages where the OS gives them."""
    out = torch.empty(shape, dtype=dtype)
    if os.environ.get("PAGEDQ_HUGE_PAGES", "1") != "0":
        advise_huge_pages(out)
    return out.zero_()
