"""The long-lived service around one engine: RQ batch worker, CLI and metrics."""

from __future__ import annotations

import os
from typing import Any

# oneDNN's primitive cache and torch's mkldnn LRU cache keep a compiled kernel per input shape,
# and a step's token count changes nearly every step: with their default 1024 entries a worker
# grew 66 MB per 1,000 jobs for 10,000 jobs (bench/soak.py). Bounded, its RSS stays flat. Set
# here, before anything in the worker imports torch (both are read at their first use); a value
# of the operator's own wins.
CACHE_CAPACITY_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
for _name in CACHE_CAPACITY_ENV:
    os.environ.setdefault(_name, "128")

__all__ = ["WorkerConfig"]


def __getattr__(name: str) -> Any:
    # Lazy: WorkerConfig imports the engine (torch); worker.redis_server and friends do not.
    if name == "WorkerConfig":
        from worker.config import WorkerConfig

        return WorkerConfig
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
