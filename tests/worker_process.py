"""Real `python -m worker` child processes for tests (tests/worker and tests/producer)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from producer.connection import redis_client
from producer.contract.keys import worker_key

REPO = Path(__file__).resolve().parents[1]
MODEL = os.environ.get("PAGEDQ_TEST_MODEL", "smollm2")
# Small KV budget and short leases keep the tests quick on a 2-core CPU.
KV_CACHE_MEMORY = "64MiB"
LEASE_TTL = 4
# Model loads take minutes when helpers share the 2 cores.
WORKER_READY_TIMEOUT = 900.0


class WorkerProcess:
    """A `python -m worker` child process with its log file.

    `env` adds variables to the child's environment (e.g. OMP_NUM_THREADS=1).
    """

    def __init__(
        self,
        redis_url: str,
        queue: str,
        name: str,
        log_dir: Path,
        *extra: str,
        model: str = MODEL,
        kv_cache_memory: str = KV_CACHE_MEMORY,
        lease_ttl: int = LEASE_TTL,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        cmd = [
            sys.executable, "-m", "worker",
            "--redis-url", redis_url,
            "--queue", queue,
            "--model", model,
            "--name", name,
            "--kv-cache-memory", kv_cache_memory,
            "--lease-ttl", str(lease_ttl),
            "--log-level", os.environ.get("PAGEDQ_TEST_LOG_LEVEL", "INFO"),
            *extra,
        ]  # fmt: skip
        child_env = {**os.environ, **env} if env else None
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=child_env
            )
        self._redis = redis_client(redis_url)

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

    def wait_log(self, text: str, timeout: float = 60.0) -> None:
        """Wait until `text` is in the worker's log: a line is written just after the Redis
        change it reports, which a test may see first."""
        deadline = time.monotonic() + timeout
        while text not in self.log_path.read_text(errors="replace"):
            assert time.monotonic() < deadline, f"{text!r} not logged:\n{self.log_tail()}"
            time.sleep(0.05)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """SIGSTOP the process for the block (it takes no job meanwhile), SIGCONT after."""
        self.process.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self.process.send_signal(signal.SIGCONT)

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
