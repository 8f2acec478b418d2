"""The long-lived service around one engine: RQ batch worker, CLI and metrics."""

from __future__ import annotations

from typing import Any

__all__ = ["WorkerConfig"]


def __getattr__(name: str) -> Any:
    # Lazy: WorkerConfig imports the engine (torch); worker.redis_server and friends do not.
    if name == "WorkerConfig":
        from worker.config import WorkerConfig

        return WorkerConfig
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
