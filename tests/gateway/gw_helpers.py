"""Helpers of the gateway tests: gateway processes, batch files, polling."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from openai import OpenAI
from worker_process import REPO

from worker.redis_server import free_port

__all__ = [
    "KEY",
    "KEYS",
    "QUEUE",
    "REPO",
    "GatewayProcess",
    "batch_file",
    "chat_line",
    "wait_batch",
]

QUEUE = "gw"
KEYS = {
    "sk-team-a": {"tenant": "team-a", "priority": 0, "batch_priority": 10},
    "sk-team-b": {"tenant": "team-b"},
}
KEY = "sk-team-a"


class GatewayProcess:
    """A `pagedq serve` child process on a free port, with its log file."""

    def __init__(self, redis_url: str, log_dir: Path, keys_file: Path | None, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"gateway-{self.port}.log"
        cmd = [sys.executable, "-m", "pagedq_cli", "serve", "--redis-url", redis_url]
        cmd += ["--queue", QUEUE, "--port", str(self.port), "--log-level", "warning", *extra]
        if keys_file is not None:
            cmd += ["--api-keys-file", str(keys_file)]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        self.wait_ready()

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until /health answers 200."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gateway exited early:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"gateway not ready:\n{self.log_tail()}")

    def openai(self, key: str = KEY, **kwargs) -> OpenAI:
        """OpenAI's SDK pointed at this gateway: only the base URL and the key change."""
        return OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kwargs)

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the gateway's log."""
        return self.log_path.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        """SIGKILL: nothing is cleaned up."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        """SIGTERM and wait."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def wait_batch(client: OpenAI, batch_id: str, statuses: tuple[str, ...], timeout: float = 120):
    """Poll a batch until its status is one of `statuses`."""
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch_id} still {batch.status}: {batch}")
        time.sleep(0.2)


def batch_file(lines: list[dict]) -> bytes:
    """A JSONL batch file of `lines`."""
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def chat_line(custom_id: str, content: str, max_tokens: int = 8, **body) -> dict:
    """One /v1/chat/completions batch line (greedy)."""
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "any",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            **body,
        },
    }
