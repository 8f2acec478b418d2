"""Large CPU buffers backed by transparent huge pages (Linux), for the paged KV cache.

A decode reads each request's K/V as 4 KiB runs (one block of one head) scattered over a pool
of gigabytes: with 4 KiB pages nearly every run is a TLB miss and a page walk. Asking the kernel
for 2 MiB pages (``madvise(MADV_HUGEPAGE)``; the usual THP setting is ``madvise``, so plain
allocations never get them) made the C++ decode attention 0.89x the time on a 2-core EPYC
(docs/PERFORMANCE.md). The buffer is a fresh anonymous mapping: memory that malloc hands back
from its heap may already be faulted in as small pages, which the advice no longer changes.
``PAGEDQ_HUGE_PAGES=0`` turns it off; without ``MADV_HUGEPAGE`` (not Linux) the buffer is an
ordinary ``torch.zeros``.
"""

from __future__ import annotations

import math
import mmap
import os

import torch

HUGE_PAGE_BYTES = 2 << 20


def huge_pages_enabled() -> bool:
    """True where buffers are asked for huge pages: Linux, and not ``PAGEDQ_HUGE_PAGES=0``."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("PAGEDQ_HUGE_PAGES", "1") != "0"


def zeros_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype)`` on the CPU, on huge pages where the OS gives them.

    The memory is committed here (zeroed), as ``torch.zeros`` commits it, so that a pool too
    large for the machine fails at start and not in the middle of a step.
    """
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not huge_pages_enabled() or nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    # Private (a shared anonymous mapping is shmem, whose THP setting is another, usually off),
    # with one spare huge page so that the tensor can start on a 2 MiB boundary.
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr()
    offset = -start % HUGE_PAGE_BYTES
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    except OSError:
        pass  # THP compiled out or refused: small pages, same numbers
    out = torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset).view(shape)
    return out.zero_()  # the tensor keeps `buf` alive
