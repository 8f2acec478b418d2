"""Worker RSS over many jobs: does a long-lived worker's memory stay flat?

Starts a private redis-server and one real `python -m worker` process (tests/worker_process.py,
the same child the worker tests run), submits N short jobs (max_tokens 1-4, greedy, distinct
prompts) in chunks through `Client.enqueue` (what `Client.submit_many` runs per chunk, here
with a notify id so that ends are read from one events stream, as `pagedq submit` reads them),
keeps at most `--window` jobs outstanding, and every `--sample-every` finished jobs samples:

- the worker process's RSS (VmRSS, /proc/PID/status),
- Redis's used_memory, and its growth per finished job since the worker was ready.

It prints the series, then the RSS growth from the first sample at or after `--warmup` jobs
to the end (MB and %), its slope per 1,000 jobs, and what Redis holds per job by kind of key
(every finished job leaves its result, its RQ job hash and registry entry for --result-ttl).

    .venv/bin/python bench/soak.py                     # 10,000 jobs, model smollm2
    .venv/bin/python bench/soak.py --jobs 2000 --model /path/to/model
    .venv/bin/python bench/soak.py --jobs 4000 --env ONEDNN_PRIMITIVE_CACHE_CAPACITY=16
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import redis

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "bench")]

from redis_ops import memory_by_kind  # noqa: E402
from worker_process import WorkerProcess  # noqa: E402

from producer.client import Client  # noqa: E402
from producer.contract.schema import GenerationRequest  # noqa: E402
from producer.events import EventFollower  # noqa: E402
from producer.results import final_result, is_final  # noqa: E402
from worker.redis_server import PrivateRedis  # noqa: E402

QUEUE = "soak"


def rss_bytes(pid: int) -> int:
    """VmRSS of a process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def requests(n: int, seed: int = 0):
    """N short greedy requests with distinct prompts."""
    rng = random.Random(seed)
    for i in range(n):
        yield GenerationRequest.parse(
            {
                "prompt": f"Job {i}: say one word about the number {rng.randrange(10**6)}.",
                "max_tokens": rng.randint(1, 4),
                "temperature": 0.0,
                "ignore_eos": True,
            }
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=10_000)
    p.add_argument("--model", default="smollm2", help="model name or path for the worker")
    p.add_argument("--sample-every", type=int, default=500)
    p.add_argument("--warmup", type=int, default=1000, help="jobs before the growth baseline")
    p.add_argument("--window", type=int, default=256, help="jobs outstanding at most")
    p.add_argument("--chunk", type=int, default=64, help="jobs per enqueue call")
    p.add_argument("--kv-cache-memory", default="64MiB")
    p.add_argument("--lease-ttl", type=int, default=60)
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for the worker (e.g. ONEDNN_PRIMITIVE_CACHE_CAPACITY=16)",
    )
    args = p.parse_args()
    env = dict(item.split("=", 1) for item in args.env)

    with PrivateRedis() as server, tempfile.TemporaryDirectory() as logs:
        t_load = time.monotonic()
        w = WorkerProcess(
            server.url,
            QUEUE,
            "soak-w",
            Path(logs),
            model=args.model,
            kv_cache_memory=args.kv_cache_memory,
            lease_ttl=args.lease_ttl,
            env=env or None,
        )
        try:
            w.wait_ready()
            print(f"worker ready in {time.monotonic() - t_load:.0f} s, pid {w.process.pid}")
            admin = server.client()
            conn = redis.Redis.from_url(server.url)
            client = Client(connection=conn, queue=QUEUE)
            follower = EventFollower(conn, notify="soak")
            follower.open()
            time.sleep(1.0)
            used0 = admin.info("memory")["used_memory"]
            pid = w.process.pid
            samples = [(0, 0.0, rss_bytes(pid), used0)]
            print(f"{'jobs':>7} {'s':>7} {'jobs/s':>7} {'RSS MB':>9} {'Redis MB':>9} {'B/job':>7}")
            print(f"{0:>7} {0.0:>7.1f} {'':>7} {samples[0][2] / 2**20:>9.1f} {used0 / 1e6:>9.2f}")
            todo = requests(args.jobs)
            submitted = done = failed = 0
            t0 = time.monotonic()
            next_sample = args.sample_every
            while done < args.jobs:
                while submitted < args.jobs and submitted - done < args.window:
                    n = min(args.chunk, args.jobs - submitted, args.window - (submitted - done))
                    chunk = [next(todo) for _ in range(n)]
                    for job_id in client.enqueue(chunk, notify=follower.notify):
                        follower.add(job_id)
                    submitted += n
                for job_id, entry in follower.read(1.0):
                    if not is_final(entry):
                        continue
                    done += 1
                    failed += final_result(conn, job_id, entry).status != "finished"
                if w.process.poll() is not None:
                    raise RuntimeError(f"worker exited:\n{w.log_tail()}")
                if done >= next_sample or done == args.jobs:
                    next_sample += args.sample_every
                    t = time.monotonic() - t0
                    rss = rss_bytes(pid)
                    used = admin.info("memory")["used_memory"]
                    samples.append((done, t, rss, used))
                    print(
                        f"{done:>7} {t:>7.1f} {done / t:>7.1f} {rss / 2**20:>9.1f} "
                        f"{used / 1e6:>9.2f} {(used - used0) / done:>7.0f}",
                        flush=True,
                    )
            kinds = memory_by_kind(admin)
        finally:
            w.stop()

    base = next((s for s in samples if s[0] >= args.warmup), samples[-1])
    last = samples[-1]
    grow = last[2] - base[2]
    print(f"\n{args.jobs} jobs ({failed} not finished) in {last[1]:.0f} s")
    print(
        f"RSS after {base[0]} jobs: {base[2] / 2**20:.1f} MB; after {last[0]}: "
        f"{last[2] / 2**20:.1f} MB; growth {grow / 2**20:+.1f} MB "
        f"({grow / base[2]:+.1%}), {grow / 2**20 / max(1, last[0] - base[0]) * 1000:+.2f} MB "
        "per 1,000 jobs"
    )
    tail = [s for s in samples if s[0] >= base[0]]
    if len(tail) >= 3:
        xs, ys = [s[0] for s in tail], [s[2] for s in tail]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        print(
            f"least-squares RSS slope after warm-up: {slope * 1000 / 2**20:+.2f} MB per 1,000 jobs"
        )
    print(
        f"Redis used_memory growth: {(last[3] - samples[0][3]) / last[0]:.0f} B per finished job; "
        f"keys left: {sum(kinds.values()) / last[0]:.0f} B per job (MEMORY USAGE), by kind:"
    )
    for kind, size in kinds.most_common(10):
        print(f"  {kind:<28}{size / last[0]:8.0f} B")


if __name__ == "__main__":
    main()
