"""Redis CPU per job of each step of a job's life, by how many jobs one call carries.

One quiet client drives the real calls (`Client.enqueue`, the worker's DEQUEUE and END through
`RQAdapter`, the producer's result reads) against a private redis-server, `--jobs` jobs at each
batch size, and reads Redis's own CPU (INFO cpu, user + sys) around each phase. What it shows
is the fixed part of a call against the part of each job in it: what the worker's
`--coalesce-window` and `--bulk-coalesce-window` buy (worker/coalesce.py).

    .venv/bin/python bench/redis_scripts.py                 # batches 1, 8, 32; ~20 s
    .venv/bin/python bench/redis_scripts.py --batches 1 4 16 64 --jobs 4096
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from producer.client import Client  # noqa: E402
from producer.contract.keys import result_key  # noqa: E402
from producer.contract.schema import GenerationRequest, Timings  # noqa: E402
from worker.endings import build_result  # noqa: E402
from worker.redis_link import ScriptRunner  # noqa: E402
from worker.redis_server import PrivateRedis  # noqa: E402
from worker.rq_adapter import RQAdapter  # noqa: E402

QUEUE = "bench-scripts"
PROMPT = "Write a short story about a cat who learns to sail. " * 4
TOKENS = 200


def redis_cpu(conn) -> float:
    """Seconds of CPU the redis-server process has used."""
    info = conn.info("cpu")
    return info["used_cpu_sys"] + info["used_cpu_user"]


def one_batch_size(server: PrivateRedis, jobs: int, batch: int) -> dict[str, float]:
    """Redis CPU per job (us) of each phase, every call carrying `batch` jobs."""
    conn = server.client()
    conn.flushall()
    client = Client(server.url, queue=QUEUE)
    adapter = RQAdapter(server.client(), "bench-w", [QUEUE], lease_ttl=60, result_ttl=3600,
                        stream_ttl=3600, max_crashes=2)  # fmt: skip
    runner = ScriptRunner(adapter.connection)
    runner.call(adapter.register_call())
    requests = [GenerationRequest(prompt=PROMPT, max_tokens=TOKENS) for _ in range(jobs)]
    chunks = [slice(i, i + batch) for i in range(0, jobs, batch)]
    marks = [redis_cpu(conn)]
    for c in chunks:
        client.enqueue(requests[c])
    marks.append(redis_cpu(conn))
    claims = []
    while len(claims) < jobs:
        call, t = adapter.dequeue_call(batch)
        claims += adapter.claims(runner.call(call), t)
    marks.append(redis_cpu(conn))
    for c in chunks:
        calls = []
        for claim in claims[c]:
            result = build_result(claim.job_id, None, None, status="finished", model="bench",
                                  worker="bench-w", timings=Timings())  # fmt: skip
            result.token_ids, result.text = list(range(TOKENS)), "word " * TOKENS
            summary = {"job_id": claim.job_id}
            calls.append(adapter.end_call(claim, "finished", result.model_dump_json(),
                                          (60, TOKENS), {}, summary))  # fmt: skip
        runner.run(adapter.merge_ends(calls))
    marks.append(redis_cpu(conn))
    keys = [result_key(claim.job_id) for claim in claims]
    for c in chunks:
        conn.mget(keys[c])
    marks.append(redis_cpu(conn))
    client.close()
    phases = ("enqueue", "dequeue", "end", "read results")
    return {p: (b - a) * 1e6 / jobs for p, a, b in zip(phases, marks, marks[1:], strict=False)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2048)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument(
        "--redis-core",
        type=int,
        default=0,
        help="core for redis-server, this process on the others (-1: unpinned)",
    )
    args = ap.parse_args()
    with PrivateRedis() as server:
        cpus = sorted(os.sched_getaffinity(0))
        if args.redis_core >= 0 and len(cpus) >= 2:
            pid = int(server.client().info("server")["process_id"])
            os.sched_setaffinity(pid, {args.redis_core})
            os.sched_setaffinity(0, set(cpus) - {args.redis_core})
        rows = [(b, one_batch_size(server, args.jobs, b)) for b in args.batches]
    print(f"Redis CPU per job (us), {args.jobs} jobs of {TOKENS} tokens, one client")
    print("| jobs per call | enqueue | dequeue | end | read results (MGET) | all |")
    print("|---:|---:|---:|---:|---:|---:|")
    for b, r in rows:
        cells = " | ".join(f"{v:.1f}" for v in r.values())
        print(f"| {b} | {cells} | {sum(r.values()):.1f} |")


if __name__ == "__main__":
    main()
