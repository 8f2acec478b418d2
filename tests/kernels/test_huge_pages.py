"""The CPU KV cache asks Linux for transparent huge pages, and is an ordinary zeroed tensor."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import allocate_kv_cache
from kernels.huge_pages import HUGE_PAGE_BYTES, zeros_huge

ROOT = Path(__file__).resolve().parents[2]
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
linux_with_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are off or not Linux",
)


def anon_huge_kib(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings that hold ``tensor``'s memory, from /proc/self/smaps."""
    start = tensor.data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    smaps = Path("/proc/self/smaps").read_text()
    return sum(int(m["AnonHugePages"][0]) for m in mappings_over(smaps, start, end))


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


def test_the_switch_turns_it_off():
    # In a fresh process: in this one, memory that other tests touched (torch.zeros may draw on
    # malloc's heap) can already lie on huge pages, whatever the switch says.
    code = (
        "import torch\n"
        "from kernels.huge_pages import HUGE_PAGE_BYTES, zeros_huge\n"
        "out = zeros_huge((16 * HUGE_PAGE_BYTES // 4,), torch.float32)\n"
        "assert not out.any()\n"
        "print(out.data_ptr(), out.untyped_storage().nbytes())\n"
        "print(open('/proc/self/smaps').read())\n"
    )
    env = {**os.environ, "PAGEDQ_HUGE_PAGES": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    first, _, smaps = done.stdout.partition("\n")
    if not sys.platform.startswith("linux"):
        return
    start, nbytes = (int(x) for x in first.split())
    advised = [m for m in mappings_over(smaps, start, start + nbytes) if "hg" in m["VmFlags"]]
    assert advised == []  # nobody asked for huge pages on the tensor's memory


def mappings_over(smaps: str, start: int, end: int) -> list[dict[str, list[str]]]:
    """The /proc/<pid>/smaps entries (field -> words) of the mappings that overlap [start, end)."""
    found, current = [], None
    for line in smaps.splitlines():
        head = line.split()[0] if line.split() else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            current = {} if lo < end and start < hi else None
            if current is not None:
                found.append(current)
        elif current is not None and head.endswith(":"):
            current[head[:-1]] = line.split()[1:]
    return found


def test_small_buffers_are_plain_zeros():
    out = zeros_huge((7, 3), torch.float32)
    assert out.shape == (7, 3) and not out.any()
