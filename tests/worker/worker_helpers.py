"""Helpers for worker tests: real `python -m worker` processes and a producer Client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from producer.client import Client
from producer.schema import worker_key

REPO = Path(__file__).resolve().parents[2]
MODEL = os.environ.get("PAGEDQ_TEST_MODEL", "smollm2")
# Small KV budget and short leases keep the tests quick on a 2-core CPU.
KV_CACHE_MEMORY = "64MiB"
LEASE_TTL = 4
WORKER_READY_TIMEOUT = 240.0


class WorkerProcess:
    """A `python -m worker` child process with its log file."""

    def __init__(self, redis_url: str, queue: str, name: str, log_dir: Path, *extra: str) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        cmd = [
            sys.executable, "-m", "worker",
            "--redis-url", redis_url,
            "--queue", queue,
            "--model", MODEL,
            "--name", name,
            "--kv-cache-memory", KV_CACHE_MEMORY,
            "--lease-ttl", str(LEASE_TTL),
            "--log-level", os.environ.get("PAGEDQ_TEST_LOG_LEVEL", "INFO"),
            *extra,
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        self._redis = redis.Redis.from_url(redis_url)

    def wait_ready(self, timeout: float = WORKER_READY_TIMEOUT) -> None:
        """Wait for the first heartbeat (the model is loaded and the loop runs)."""
        deadline = time.monotonic() + timeout
        while self._redis.get(worker_key(self.name)) is None:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited early:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.name} not ready:\n{self.log_tail()}")
            time.sleep(0.2)

    def status(self) -> dict | None:
        """The worker's heartbeat JSON (pagedq:worker:{name})."""
        raw = self._redis.get(worker_key(self.name))
        return json.loads(raw) if raw else None

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the worker's log, for failure messages."""
        return self.log_path.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        """SIGKILL: a crash, nothing is cleaned up."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


def make_client(url: str, queue: str) -> Client:
    """A producer Client whose result waits notice ends quickly."""
    return Client(url, queue=queue, check_interval=0.5)
