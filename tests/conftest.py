"""Shared test fixtures: a real redis-server on a free port (never 6379), restartable."""

from __future__ import annotations

import os

# Triton kernels run only on CUDA or when forced; CPU tests run them under the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from worker.redis_server import PrivateRedis, find_redis_server, server_version


def pytest_report_header() -> str:
    """Which server the Redis-facing tests start (PAGEDQ_REDIS_SERVER picks another)."""
    return f"redis server: {server_version(find_redis_server())}"


@pytest.fixture(scope="session")
def redis_server() -> Iterator[PrivateRedis]:
    """One private redis-server for the whole session; tests flush it (see `redis_client`)."""
    with PrivateRedis() as server:
        yield server


@pytest.fixture
def redis_client(redis_server: PrivateRedis) -> Iterator[Redis]:
    """A client on the session server, with the database flushed before the test."""
    redis_server.start()  # a no-op unless a test killed it
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A tiny random Llama checkpoint folder (safetensors + tokenizer), made once per session."""
    from tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama"))


@pytest.fixture(scope="session")
def protocol_example() -> dict[str, str]:
    """The bash blocks of docs/PROTOCOL.md by name ("enqueue", "wait"), from the markers
    `<!-- protocol-example: NAME -->` written just above each block."""
    text = (Path(__file__).parent.parent / "docs" / "PROTOCOL.md").read_text()
    pattern = r"<!-- protocol-example: (\w+) -->\s*```bash\n(.*?)```"
    return dict(re.findall(pattern, text, flags=re.S))


# The modules that take longest (a minute or more on a 2-core VM), run first: `make test` runs
# the modules on two processes (pytest-xdist, `--dist loadfile --no-loadscope-reorder`: in this
# order, not xdist's by test count), and one of these started last would run alone at the end.
SLOWEST_FIRST = (
    "worker/test_reliability.py",
    "worker/test_partition.py",
    "engine/test_exactness.py",
    "engine/test_architectures.py",
    "worker/test_sentinel.py",
    "worker/test_architectures_worker.py",
    "gateway/test_clients.py",
    "worker/test_cpu_bind.py",
    "worker/test_scale_out.py",
    "worker/test_cluster.py",
    "worker/test_stable_name.py",
    "worker/test_coalesce.py",
    "gateway/test_batches.py",
    "producer/test_bulk.py",
    "kernels/test_build_targets.py",
    "kernels/test_compile_cuda.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the slowest modules first (a stable sort: every module keeps its own order)."""
    root = Path(__file__).parent

    def rank(item: pytest.Item) -> int:
        name = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=rank)
