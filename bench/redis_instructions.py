"""Instructions Redis executes per job in each step of a job's life: a measure that no noisy
neighbour moves.

Redis CPU time (bench/redis_capacity.py, bench/redis_scripts.py) moves by 2x between runs of one
code on a shared VM; the instructions a redis-server executes for the same calls do not (a
rerun differs by well under 1 %). This bench runs redis-server under valgrind's callgrind,
drives it with the real calls (`Client.enqueue`; the worker's DEQUEUE, STREAM and END through
`RQAdapter`; the producer's MGET of the results) and reads the instructions executed (callgrind's
`Ir`, the server's own threads, kernel time not included) in each phase. With `--baseline
PATH` (a checkout of another commit, e.g. a `git worktree`), the same phases run against that
code's scripts too, in the same process, and the table gives both and their ratio.

    .venv/bin/python bench/redis_instructions.py                      # about 10 s; needs valgrind
    git worktree add /tmp/base HEAD~1
    .venv/bin/python bench/redis_instructions.py --baseline /tmp/base --jobs 512 --batch 64

The jobs are the bench's usual ones (a prompt of 208 characters, 200 random tokens each); with
`--stream`, they are enqueued for an inline stream hub (the gateway's, taking deltas) and each gets
`--windows` token entries of three tokens before its end. Started and finished registries are
filled with `--registry` other members first, so that they are skip lists, as in a busy fleet
(a small one is a listpack, whose every insert parses the scores it passes).

With `--cpu`, the server runs without valgrind and the figures are its CPU time (INFO cpu, user
and system) per job: the round trips' system calls counted too, and the machine's noise.

With `--floor`, a last column runs the same jobs as plain commands, pipelined one round trip
per call and with no script (`floor_child`): the job hash the producer writes, the fields a
dequeue reads and writes, the registries, the result, a hub's entries, but no fence, account or
counter. The scripts' column over it is what running a job's life in Lua costs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

REPO = Path(__file__).resolve().parents[1]
PHASES = ("enqueue", "dequeue", "stream", "end", "read results")
PROMPT = "Write a short story about a cat who learns to sail. " * 4
TOKENS = 200


def measure(repo: Path, argv: list[str]) -> dict:
    """Instructions per job of each phase, with the code of `repo` (run in a child process, so
    that each checkout imports its own modules); `argv`: this bench's own options."""
    args = [sys.executable, __file__, "--child", str(repo), *argv]
    out = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"the run with {repo} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


class Callgrind:
    """A redis-server of its own under callgrind; `take()` dumps (and so zeroes) its counters
    and gives the instructions executed since the last take."""

    def __init__(self, workdir: str, server_args: list[str]) -> None:
        self.workdir = workdir
        server = os.environ.get("PAGEDQ_REDIS_SERVER") or "redis-server"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no",
             f"--callgrind-out-file={workdir}/callgrind.out.%p", shutil.which(server) or server,
             "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", workdir, *server_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 60
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError("redis-server under valgrind did not start") from None
                time.sleep(0.1)
        subprocess.run(
            ["callgrind_control", "-i", "on", str(self.process.pid)], capture_output=True
        )

    def take(self) -> int:
        before = set(os.listdir(self.workdir))
        subprocess.run(["callgrind_control", "-d", str(self.process.pid)], capture_output=True)
        for _ in range(100):
            new = [f for f in set(os.listdir(self.workdir)) - before if ".out." in f]
            if new:
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("callgrind wrote no dump")
        time.sleep(0.2)  # let the dump be written whole
        total = 0
        for name in new:
            for line in Path(self.workdir, name).read_text().splitlines():
                if line.startswith("totals:"):
                    total += int(line.split()[1])
                    break
        return total

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


class CpuClock:
    """A plain redis-server of its own (`--cpu`); `take()` gives its CPU time (INFO cpu, user
    and system: round trips' system calls included), in nanoseconds, since the last take.
    Noisy on a shared machine: compare columns of one run."""

    def __init__(self, workdir: str, server_args: list[str]) -> None:
        from worker.redis_server import PrivateRedis

        self.server = PrivateRedis(args=server_args)
        self.server.start()
        self.url = self.server.url
        self._admin = redis.Redis.from_url(self.url)
        self._last = self._cpu_ns()

    def _cpu_ns(self) -> int:
        info = self._admin.info("cpu")
        return round((info["used_cpu_sys"] + info["used_cpu_user"]) * 1e9)

    def take(self) -> int:
        now = self._cpu_ns()
        taken, self._last = now - self._last, now
        return taken

    def close(self) -> None:
        self._admin.close()
        self.server.close()


def _meter(workdir: str, server_args: list[str]) -> Callgrind | CpuClock:
    """The server a child measures: under callgrind, or plain with `--cpu`."""
    cls = CpuClock if "--cpu" in sys.argv else Callgrind
    return cls(workdir, server_args)


def _result_json(job_id: str, rng: random.Random) -> str:
    """A finished job's GenerationResult JSON, of TOKENS random tokens."""
    from producer.contract.schema import Timings
    from worker.endings import build_result

    result = build_result(
        job_id, None, None, status="finished", model="bench", worker="bench-w",
        timings=Timings(),
    )  # fmt: skip
    result.token_ids = [rng.randrange(49152) for _ in range(TOKENS)]
    result.text = "".join(f" w{rng.randrange(10**5)}" for _ in range(TOKENS))
    return result.model_dump_json()


def _end_calls(
    adapter, claim, final: dict, rng: random.Random, inline_result: bool = False
) -> tuple[list, object]:
    """The END of a finished job of TOKENS random tokens, and the SET staging its result
    before it (as the worker's JobEnder does: not in code where a hub's result went with the
    end, `inline_result`, nor in code from before staged results)."""
    summary = {"job_id": claim.job_id}
    result_json = _result_json(claim.job_id, rng)
    if inline_result or not hasattr(adapter, "stage_result"):
        return [], adapter.end_call(claim, "finished", result_json, (60, TOKENS), final, summary)
    stage = adapter.stage_result(claim, result_json)
    end = adapter.end_call(
        claim, "finished", result_json, (60, TOKENS), final, summary, staged=True
    )
    return [stage], end


@contextlib.contextmanager
def _server(server_args: list[str], registry: int) -> Iterator[tuple[Any, redis.Redis]]:
    """A measured server (`_meter`) and a connection to it, its started and finished registries
    of queue `bench` filled with `registry` other members first, so that they are skip lists,
    as in a busy fleet (a small one is a listpack, whose every insert parses its scores)."""
    from producer.contract.keys import rq_registry_key, rq_wip_key

    with tempfile.TemporaryDirectory(prefix="pagedq-callgrind-") as workdir:
        meter = _meter(workdir, server_args)
        try:
            conn = redis.Redis.from_url(meter.url)
            for registry_key in (rq_wip_key("bench"), rq_registry_key("finished", "bench")):
                if registry:
                    conn.zadd(registry_key, {f"other{i}:x": 4e9 + i for i in range(registry)})
            yield meter, conn
        finally:
            meter.close()


def _print_per_job(marks: list[int], jobs: int) -> None:
    """Each phase's take per job, as JSON (the first take, the warm-up, left out)."""
    print(json.dumps({p: n / jobs for p, n in zip(PHASES, marks[1:], strict=True)}))


def child(
    repo: Path,
    jobs: int,
    batch: int,
    stream: bool,
    windows: int,
    registry: int,
    server_args: list[str],
    ahead: int = 0,
) -> None:
    """Run the phases with the code of `repo`; print their instructions per job as JSON."""
    sys.path.insert(0, str(repo))
    from producer.client import Client
    from producer.contract import stream as stream_format
    from producer.contract.keys import result_key
    from producer.contract.schema import GenerationRequest
    from producer.contract.stream import token_entry
    from worker.redis_link import ScriptRunner
    from worker.rq_adapter import RQAdapter

    rng = random.Random(0)
    with _server(server_args, registry) as (cg, conn):
        client = Client(cg.url, queue="bench")
        adapter = RQAdapter(redis.Redis.from_url(cg.url), "bench-w", ["bench"], lease_ttl=60,
                            result_ttl=3600, stream_ttl=3600, max_crashes=2)  # fmt: skip
        runner = ScriptRunner(adapter.connection)
        runner.call(adapter.register_call())
        # The suffix the gateway's hub takes in the code measured (before DELTAS_WAKE: inline).
        suffix = getattr(stream_format, "DELTAS_WAKE", stream_format.INLINE_WAKE)
        wake = "bench-hub" + suffix if stream else None
        requests = [GenerationRequest(prompt=PROMPT, max_tokens=TOKENS) for _ in range(jobs)]
        chunks = [slice(i, i + batch) for i in range(0, jobs, batch)]
        # A hub's job: in code from before staged hub results, its result went with its
        # end (the worker's RESULT_FIELD flag, which END answered in the wake entry).
        from worker.rq_scripts import END

        inline_result = stream and "acc.results" in END.source
        final = {"event": "done", "finish_reason": "length"} if stream else {}
        if inline_result:
            final["result"] = "1"
        # One job through every step first: each script is loaded before the counting.
        client.enqueue(requests[:1], wake=wake)
        warm = adapter.claims(runner.call(adapter.dequeue_call(1)[0]), time.time())
        runner.run([adapter.stream_call([(c, token_entry("x", [1]), True) for c in warm])])
        stage, end = _end_calls(adapter, warm[0], final, rng, inline_result)
        runner.run([*stage, end])
        marks = [cg.take()]
        for c in chunks:
            client.enqueue(requests[c], wake=wake)
        marks.append(cg.take())
        claims = []
        while len(claims) < jobs:
            call, t = adapter.dequeue_call(batch, ahead)
            claims += adapter.claims(runner.call(call), t)
        marks.append(cg.take())
        for w in range(windows if stream else 0):
            for c in chunks:
                entry = [rng.randrange(49152) for _ in range(3)]
                step = [(claim, token_entry(" a b", entry), w == 0) for claim in claims[c]]
                runner.run([adapter.stream_call(step)])
        marks.append(cg.take())
        for c in chunks:
            made = [_end_calls(adapter, cl, final, rng, inline_result) for cl in claims[c]]
            stages = [s for stage, _ in made for s in stage]
            runner.run([*stages, *adapter.merge_ends([end for _, end in made])])
        marks.append(cg.take())
        keys = [result_key(claim.job_id) for claim in claims]
        for c in chunks:
            if not inline_result:  # else the hub had them with the ends
                conn.mget(keys[c])
        marks.append(cg.take())
        client.close()
    _print_per_job(marks, jobs)


def floor_child(
    repo: Path,
    jobs: int,
    batch: int,
    stream: bool,
    windows: int,
    registry: int,
    server_args: list[str],
) -> None:
    """The same jobs' life as plain commands, no script: what RQ's data model and pagedq's
    outputs write and read for them (the job hash as the producer builds it, its status moves,
    its registries, its result, a hub's entries), pipelined one round trip per call of `batch`
    jobs; no fence, no fair-queueing account, no batch or worker counter. The floor under the
    scripts' cost; print its instructions per job as JSON."""
    sys.path.insert(0, str(repo))
    from producer.client import Client
    from producer.contract import stream as stream_format
    from producer.contract.keys import JOB_FIELDS as F
    from producer.contract.keys import (
        result_key,
        rq_job_key,
        rq_queue_key,
        rq_registry_key,
        rq_wip_key,
        wake_key,
    )
    from producer.contract.schema import GenerationRequest
    from producer.contract.stream import (
        ENTRIES_FIELD,
        done_entry,
        encode_inline,
        inline_entry,
        token_entry,
    )

    # What DEQUEUE reads of a queue head (PICK_LUA's HEAD).
    head_fields = [F["enqueued"], F["cost"], "status", "data", "enqueued_at", "timeout",
                   F["attempts"], F["notify"], F["batch"], F["wake"]]  # fmt: skip
    rng = random.Random(0)
    wake = "bench-hub" + stream_format.DELTAS_WAKE if stream else None
    with _server(server_args, registry) as (cg, conn):
        client = Client(cg.url, queue="bench")
        request = GenerationRequest(prompt=PROMPT, max_tokens=TOKENS)
        [sample] = client.enqueue([request], wake=wake)
        fields = {k.decode(): v for k, v in conn.hgetall(rq_job_key(sample)).items()}
        qkey = rq_queue_key("bench")
        conn.delete(qkey)
        ids = [f"{sample[:-8]}{i:08x}" for i in range(jobs)]
        chunks = [ids[i : i + batch] for i in range(0, jobs, batch)]
        marks = [cg.take()]
        for chunk in chunks:
            pipe = conn.pipeline(transaction=False)
            for job_id in chunk:
                pipe.hset(rq_job_key(job_id), mapping=fields)
            pipe.rpush(qkey, *chunk)
            pipe.execute()
        marks.append(cg.take())
        now = time.time()
        started = {"status": "started", "started_at": now, "last_heartbeat": now,
                   "worker_name": "bench-w"}  # fmt: skip
        for _ in chunks:
            popped = [i.decode() for i in conn.lpop(qkey, batch)]
            pipe = conn.pipeline(transaction=False)
            for job_id in popped:
                pipe.hmget(rq_job_key(job_id), head_fields)
                pipe.hset(rq_job_key(job_id), mapping=started)
            pipe.zadd(rq_wip_key("bench"), {f"{j}:0": now + 60 for j in popped})
            pipe.execute()
        marks.append(cg.take())
        for _ in range(windows if stream else 0):
            for chunk in chunks:
                entry = token_entry(" a b", [rng.randrange(49152) for _ in range(3)])
                data = encode_inline({j: [inline_entry(wake, entry)] for j in chunk})
                conn.xadd(wake_key(wake), {ENTRIES_FIELD: data})
        marks.append(cg.take())
        final = done_entry("length")
        for chunk in chunks:
            pipe = conn.pipeline(transaction=False)
            for job_id in chunk:
                pipe.set(result_key(job_id), _result_json(job_id, rng), ex=3600)
                pipe.hmget(rq_job_key(job_id), ["status", F["execution"]])
                pipe.hset(rq_job_key(job_id), mapping={"status": "finished",
                                                       "ended_at": now})  # fmt: skip
                pipe.expire(rq_job_key(job_id), 3600)
            pipe.zrem(rq_wip_key("bench"), *[f"{j}:0" for j in chunk])
            pipe.zadd(rq_registry_key("finished", "bench"), {j: now + 3600 for j in chunk})
            if stream:
                data = encode_inline({j: [inline_entry(wake, final)] for j in chunk})
                pipe.xadd(wake_key(wake), {ENTRIES_FIELD: data})
            pipe.execute()
        marks.append(cg.take())
        for chunk in chunks:
            conn.mget([result_key(j) for j in chunk])
        marks.append(cg.take())
        client.close()
    _print_per_job(marks, jobs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64, help="jobs per call")
    ap.add_argument(
        "--ahead", type=int, default=0, help="DEQUEUE's `ahead` (a worker's --prefetch)"
    )
    ap.add_argument("--stream", action="store_true", help="jobs stream to an inline hub")
    ap.add_argument("--windows", type=int, default=10, help="token entries per streamed job")
    ap.add_argument("--registry", type=int, default=1000, help="other members per registry")
    ap.add_argument("--baseline", type=Path, help="a checkout of the code to compare with")
    ap.add_argument(
        "--server-args",
        default="",
        help="redis-server options, e.g. '--hash-max-listpack-value 4096' (both runs)",
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="add a column: the same jobs as plain commands, no script (floor_child)",
    )
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="Redis CPU time instead of instructions: no valgrind, system calls included, noisy",
    )
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--floor-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        run = floor_child if args.floor_child else child
        extra = () if args.floor_child else (args.ahead,)
        run(args.child, args.jobs, args.batch, args.stream, args.windows, args.registry,
            args.server_args.split(), *extra)  # fmt: skip
        return
    if not args.cpu and not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        print("valgrind (callgrind) is not installed: nothing measured")
        return
    runs = [("this checkout", REPO)]
    if args.baseline:
        runs.insert(0, ("baseline", args.baseline.resolve()))
    argv = ["--jobs", str(args.jobs), "--batch", str(args.batch), "--windows",
            str(args.windows), "--registry", str(args.registry), "--ahead", str(args.ahead),
            f"--server-args={args.server_args}"]  # fmt: skip
    if args.stream:
        argv.append("--stream")
    if args.cpu:
        argv.append("--cpu")
    results = [measure(repo, argv) for _, repo in runs]
    if args.floor:
        runs.append(("plain commands", REPO))
        results.append(measure(REPO, [*argv, "--floor-child"]))
    kind = f"streamed to an inline hub, {args.windows} entries each" if args.stream else "bulk"
    server = f", redis-server {args.server_args}" if args.server_args else ""
    what = ("Redis CPU per job (INFO cpu, ns)" if args.cpu
            else "Instructions redis-server executes per job (callgrind Ir)")  # fmt: skip
    print(f"{what}, {args.jobs} jobs, {kind}, {args.batch} jobs per call, ahead {args.ahead}"
          f"{server}")  # fmt: skip
    phases = [p for p in PHASES if args.stream or p != "stream"]
    print(
        "| step | "
        + " | ".join(name for name, _ in runs)
        + (" | ratio |" if args.baseline else " |")
        + (" scripts / plain |" if args.floor else "")
    )
    print("|---|" + "---:|" * (len(runs) + (1 if args.baseline else 0) + (1 if args.floor else 0)))
    for phase in [*phases, "all"]:
        values = [sum(r[p] for p in phases) if phase == "all" else r[phase] for r in results]
        cells = " | ".join(f"{v:,.0f}" for v in values)
        compared = values[:2] if args.baseline else values[:1]
        ratio = f" | {compared[-1] / compared[0]:.2f} |" if args.baseline and values[0] else " |"
        if args.floor:
            ratio += f" {values[-2] / values[-1]:.2f} |" if values[-1] else " - |"
        print(f"| {phase} | {cells}{ratio}")


if __name__ == "__main__":
    main()
