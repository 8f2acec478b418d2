"""Redis commands per finished job, producer and worker, by command name.

Starts a private redis-server on a free port and a real `python -m worker` process, submits N
short jobs with the producer `Client`, waits for every result, and reports:

- INFO commandstats before/after (every command Redis executed, script-internal ones too),
- the memory the jobs left in Redis, by kind of key (MEMORY USAGE),
- MONITOR's split of the same commands: sent by the producer, sent by the worker, and run
  inside each Lua script. Stream entries (the per-step token script) are counted separately.

    .venv/bin/python bench/redis_ops.py --jobs 50 --max-tokens 8
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import redis

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from worker_process import WorkerProcess  # noqa: E402

from producer.client import Client  # noqa: E402
from producer.enqueue import ENQUEUE_IF_ABSENT  # noqa: E402
from worker.redis_server import PrivateRedis  # noqa: E402
from worker.rq_scripts import SCRIPTS  # noqa: E402

PRODUCER_NAME = "bench-producer"


def commandstats(connection: redis.Redis) -> Counter:
    """calls per command name from INFO commandstats."""
    info = connection.info("commandstats")
    return Counter({k.removeprefix("cmdstat_"): v["calls"] for k, v in info.items()})


class Monitor:
    """Collects MONITOR lines on a thread: (client address or 'lua', command, args)."""

    def __init__(self, connection: redis.Redis) -> None:
        self.lines: list[tuple[str, str, list[str]]] = []
        self._monitor = connection.monitor()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Monitor:
        self._monitor.__enter__()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                m = self._monitor.next_command()
            except (redis.RedisError, OSError, ValueError):
                return  # the monitor connection was closed
            if m is None:
                continue
            parts = (m["command"] or "").split(" ", 2)
            addr = m["client_address"]
            if m["client_port"]:
                addr = f"{addr}:{m['client_port']}"
            self.lines.append(
                (addr, parts[0].strip('"').upper(), [a.strip('"') for a in parts[1:2]])
            )

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._monitor.__exit__(*exc)


def memory_by_kind(connection: redis.Redis) -> Counter:
    """Bytes Redis holds per kind of key (MEMORY USAGE), keys named by their prefix."""
    sizes: Counter = Counter()
    for key in connection.scan_iter(count=1000):
        name = key.decode(errors="replace")
        parts = name.split(":")
        kind = ":".join(parts[:2]) if len(parts) > 2 else name
        sizes[kind] += connection.memory_usage(key, samples=0) or 0
    return sizes


def split(lines, producer_addrs: set[str], script_names: dict[str, str]):
    """Counters: producer, worker (client-sent), stream (token script and its internals), lua."""
    producer, worker, stream, lua = Counter(), Counter(), Counter(), Counter()
    current = None  # the script whose internal commands follow
    for addr, cmd, args in lines:
        if addr == "lua":
            (stream if current == "stream" else lua)[f"{current}:{cmd}"] += 1
            continue
        current = script_names.get(args[0], "?") if cmd == "EVALSHA" and args else None
        if cmd == "EVALSHA" and current == "stream":
            stream["EVALSHA(stream)"] += 1
        elif addr.split(":")[0] in ("", "lua"):
            continue
        elif addr in producer_addrs:
            producer[cmd] += 1
        else:
            worker[cmd if cmd != "EVALSHA" else f"EVALSHA({current})"] += 1
    return producer, worker, stream, lua


def _sha(script) -> str:
    return hashlib.sha1(script.source.encode()).hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--model", default="smollm2")
    args = p.parse_args()

    with PrivateRedis() as server, tempfile.TemporaryDirectory() as logs:
        w = WorkerProcess(server.url, "bench", "bench-w", Path(logs), model=args.model)
        try:
            w.wait_ready()
            admin = server.client()
            producer = redis.Redis.from_url(server.url, client_name=PRODUCER_NAME)
            client = Client(connection=producer, queue="bench", check_interval=2.0)
            producer.ping()
            time.sleep(1.0)  # let the worker settle into its idle polling
            admin.config_resetstat()
            before = commandstats(admin)
            t0 = time.monotonic()
            with Monitor(server.client()) as monitor:
                ids = client.submit_many(
                    {"prompt": f"Say a word {i}", "max_tokens": args.max_tokens,
                     "ignore_eos": True, "temperature": 0.0}
                    for i in range(args.jobs)
                )  # fmt: skip
                for job_id in ids:
                    client.result(job_id, timeout=600)
                elapsed = time.monotonic() - t0
                time.sleep(0.5)
                addrs = {
                    f"{c['addr']}" for c in admin.client_list() if c.get("name") == PRODUCER_NAME
                }
            after = commandstats(admin)
            memory = memory_by_kind(admin)
            used = admin.info("memory")["used_memory"]
        finally:
            w.stop()
    n = args.jobs
    names = {_sha(s): s.name for s in SCRIPTS}
    names[_sha(ENQUEUE_IF_ABSENT)] = "producer enqueue"
    producer_c, worker_c, stream_c, lua_c = split(monitor.lines, addrs, names)
    stats = after - before
    stats.pop("config|resetstat", None)
    stats.pop("monitor", None)
    stats.pop("info", None)

    def show(title: str, counter: Counter) -> float:
        total = sum(counter.values()) / n
        print(f"\n{title}: {total:.2f} per job")
        for name, calls in counter.most_common():
            print(f"  {name:<28}{calls / n:8.2f}")
        return total

    print(f"{n} jobs, max_tokens={args.max_tokens}, {elapsed:.1f} s")
    p_total = show("producer, commands sent", producer_c)
    w_total = show("worker, commands sent (without stream entries)", worker_c)
    show("stream entries (token script calls and what runs inside them)", stream_c)
    lua_total = show("inside the other scripts (run by Redis, not round trips)", lua_c)
    show("INFO commandstats, everything Redis executed", stats)
    print(f"\nproducer + worker commands sent per finished job: {p_total + w_total:.2f}")
    print(f"... plus the commands run inside their scripts: {p_total + w_total + lua_total:.2f}")
    print(
        f"\nRedis memory left per finished job (MEMORY USAGE by key kind): "
        f"{sum(memory.values()) / n:.0f} B (used_memory {used / 1e6:.1f} MB in all)"
    )
    for kind, size in memory.most_common(12):
        print(f"  {kind:<28}{size / n:8.0f} B")


if __name__ == "__main__":
    main()
