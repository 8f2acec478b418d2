"""Shared test fixtures: a real redis-server on a free port (never 6379), restartable."""

from __future__ import annotations

import os

# Triton kernels run only on CUDA or when forced; CPU tests run them under the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")

import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from redis import Redis, RedisError


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private redis-server process: `.url`, `.client()`, `.stop()`, `.start()`, `.restart()`.

    The port stays the same across restarts, so clients reconnect to the same URL.
    """

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.mkdtemp(prefix="pagedq-redis-")
        self._proc: subprocess.Popen | None = None

    def start(self, timeout: float = 10.0) -> None:
        """Start the server (no persistence) and wait until it answers PING."""
        if self._proc is not None:
            return
        cmd = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self._dir,
        ]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with Redis(port=self.port, socket_connect_timeout=0.2) as r:
                    r.ping()
                return
            except (OSError, RedisError):
                pass
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Kill the server (SIGKILL, like a crash); its data is gone."""
        if self._proc is None:
            return
        self._proc.kill()
        self._proc.wait(timeout=10)
        self._proc = None

    def restart(self) -> None:
        """stop() then start() on the same port."""
        self.stop()
        self.start()

    def client(self, **kwargs) -> Redis:
        """A new redis-py client on this server."""
        return Redis.from_url(self.url, **kwargs)

    def cleanup(self) -> None:
        """Stop the server and remove its working directory."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the whole session; tests flush it (see `redis_client`)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH")
    server = RedisServer()
    server.start()
    yield server
    server.cleanup()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[Redis]:
    """A client on the session server, with the database flushed before the test."""
    if redis_server._proc is None:
        redis_server.start()
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[..., RedisServer]]:
    """Make extra private servers (e.g. to kill one); all of them are cleaned up after the test."""
    servers: list[RedisServer] = []

    def make(port: int | None = None) -> RedisServer:
        server = RedisServer(port)
        servers.append(server)
        server.start()
        return server

    yield make
    for server in servers:
        server.cleanup()


@pytest.fixture(scope="session")
def protocol_example() -> dict[str, str]:
    """The bash blocks of docs/PROTOCOL.md by name ("enqueue", "wait"), from the markers
    `<!-- protocol-example: NAME -->` written just above each block."""
    text = (Path(__file__).parent.parent / "docs" / "PROTOCOL.md").read_text()
    pattern = r"<!-- protocol-example: (\w+) -->\s*```bash\n(.*?)```"
    return dict(re.findall(pattern, text, flags=re.S))
