"""The CPU KV cache asks Linux for transparent huge pages, and is an ordinary zeroed tensor."""

import sys
from pathlib import Path

import pytest
import torch

from kernels import allocate_kv_cache
from kernels.huge_pages import HUGE_PAGE_BYTES, zeros_huge

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
linux_with_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are off or not Linux",
)


def anon_huge_kib(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings that hold ``tensor``'s memory, from /proc/self/smaps."""
    start = tensor.data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and start < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


def test_zeros_huge_is_zeros_of_the_shape_and_dtype():
    out = zeros_huge((3, 5, 7), torch.bfloat16)
    assert out.shape == (3, 5, 7) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert not out.any()


@linux_with_thp
def test_a_large_buffer_is_backed_by_huge_pages():
    # Small enough for malloc to serve from its heap (memory already faulted in small pages).
    torch.empty(24 << 20, dtype=torch.uint8).fill_(1)
    out = zeros_huge((16 * HUGE_PAGE_BYTES // 4,), torch.float32)
    assert out.data_ptr() % HUGE_PAGE_BYTES == 0
    assert anon_huge_kib(out) >= 15 * HUGE_PAGE_BYTES // 1024


@linux_with_thp
def test_the_cpu_kv_cache_is_on_huge_pages():
    cache = allocate_kv_cache(2048, 16, 3, 64, torch.float32, "cpu", backend="cpu")
    assert anon_huge_kib(cache) >= 20 * HUGE_PAGE_BYTES // 1024  # 24 MiB of cache


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("PAGEDQ_HUGE_PAGES", "0")
    out = zeros_huge((16 * HUGE_PAGE_BYTES // 4,), torch.float32)
    assert not out.any()
    if sys.platform.startswith("linux") and THP.exists() and "[always]" not in THP.read_text():
        assert anon_huge_kib(out) == 0


def test_small_buffers_are_plain_zeros():
    out = zeros_huge((7, 3), torch.float32)
    assert out.shape == (7, 3) and not out.any()
