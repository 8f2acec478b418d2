"""What the host CPU can do, read once from ``/proc/cpuinfo``."""

from __future__ import annotations

import functools


@functools.cache
def cpuinfo_field(name: str) -> str:
    """The first ``name`` line's value in ``/proc/cpuinfo``, e.g. "cpu family" ("" if none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where ``/proc/cpuinfo`` cannot be read)."""
    return frozenset(cpuinfo_field("flags").split())


def cpu_has_amx() -> bool:
    """True where AMX tiles compute bf16 matrix products (Sapphire Rapids and later)."""
    # Only AMX makes bf16 products beat fp32. With AVX512-BF16 alone, oneDNN's bf16 projections
    # measured 1.3-1.6x slower than fp32, and a decode step at batch 64 1.22x slower; without
    # either, bf16 is emulated and about 2.5x slower (docs/PERFORMANCE.md).
    return "amx_bf16" in cpu_flags()
