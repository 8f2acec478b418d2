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
