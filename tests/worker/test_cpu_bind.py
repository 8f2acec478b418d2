"""A CPU worker that uses every core pins its OpenMP threads, one per core, in the same process."""

from __future__ import annotations

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
