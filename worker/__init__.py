"""The long-lived service around one engine: RQ batch worker, CLI and metrics."""

from worker.config import WorkerConfig

__all__ = ["WorkerConfig"]
