"""A CPU worker that uses every core pins its OpenMP threads, one per core, in the same process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from engine.config import EngineConfig
from engine.cpu_threads import physical_cores
from worker.cli import pin_threads_and_reexec


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().partition("=")[::2] for item in raw if item)


@pytest.mark.parametrize("bind", ["auto", "none"])
def test_worker_pins_threads_unless_told_not_to(
    bind, worker_factory, tiny_llama_dir, private_redis, monkeypatch
):
    for name in ("OMP_NUM_THREADS", "GOMP_CPU_AFFINITY"):  # the runner's own, if any
        monkeypatch.delenv(name, raising=False)
    w = worker_factory(
        f"pin-{bind}", f"pin-{bind}", "--model", tiny_llama_dir,
        env={"PAGEDQ_CPU_BIND": bind},
    )  # fmt: skip
    w.wait_ready()
    env = _environ(w.process.pid)  # the same PID: the worker replaced itself, no child
    cores = " ".join(map(str, physical_cores()))
    if bind == "auto":
        assert env.get("GOMP_CPU_AFFINITY") == cores
        assert env.get("OMP_NUM_THREADS") == str(len(physical_cores()))
    else:
        assert not env.get("GOMP_CPU_AFFINITY")
    assert redis.Redis.from_url(private_redis.url).ping()
    assert w.stop() == 0


def test_unknown_cpu_bind_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("PAGEDQ_CPU_BIND", "off")
    with pytest.raises(ValueError, match=r"PAGEDQ_CPU_BIND='off'.*\['auto', 'none'\]"):
        pin_threads_and_reexec(EngineConfig(device="cpu"), [])


_POOL_PROBE = """
import os, sys, time
from engine import LLMEngine
from engine.config import EngineConfig
from worker.config import WorkerConfig
from worker.service import build_engine
config = WorkerConfig(engine=EngineConfig(model=sys.argv[1], device="cpu", kv_cache_memory="64MiB"))
before = len(os.listdir("/proc/self/task"))
LLMEngine(config.engine) if sys.argv[2] == "main" else build_engine(config)
deadline = time.monotonic() + 10  # threads that ended leave /proc a moment after the join
while len(os.listdir("/proc/self/task")) > before and time.monotonic() < deadline:
    time.sleep(0.05)
print(len(os.listdir("/proc/self/task")) - before)
"""


def test_the_model_loads_on_a_thread_whose_openmp_pool_ends_with_it(tiny_llama_dir):
    """Loaded on the main thread, the model leaves an OpenMP pool there (one more OS thread):
    with the engine thread's own, the process has more pool threads than CPUs and libgomp
    stops spinning between ops. build_engine loads on a thread that ends, taking its pool."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(root)}
    env.pop("GOMP_CPU_AFFINITY", None)

    def extra_threads(where: str) -> int:
        cmd = [sys.executable, "-c", _POOL_PROBE, tiny_llama_dir, where]
        done = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout.split()[-1])

    assert extra_threads("main") == 1  # the control: loading opens a pool of 2 threads
    assert extra_threads("build_engine") == 0
