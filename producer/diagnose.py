"""`pagedq diagnose`: what limits throughput, in plain words, from the workers' Redis status.

Reads only Redis (never torch): the status each worker publishes under ``pagedq:worker:{name}``
(fields in worker/status_report.py and docs/SCHEDULING.md) and the length of the queues.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from redis import Redis
from rq import Queue

from producer.client import Client
from producer.contract.shards import hash_tag
from producer.status import read_worker_statuses

KV_PRESSURE = 0.9  # KV usage from which the batch is taken as memory bound
HIGH_PREEMPTION_RATE = 0.1  # preemptions per scheduled request
STALE_SECONDS = 120.0  # a status older than this is from a worker that stopped heartbeating


@dataclass
class Finding:
    """One thing that limits throughput, and the setting that changes it."""

    # memory_pressure | not_admitted | preemption_rate | queue_time | idle | capacity | stale
    kind: str
    worker: str | None
    message: str
    setting: str

    def __str__(self) -> str:
        where = f"[{self.worker}] " if self.worker else ""
        return f"{where}{self.message}\n    -> {self.setting}"


def _num(w: Mapping[str, Any], key: str, default: float = 0) -> float:
    value = w.get(key, default)
    return value if isinstance(value, int | float) and not isinstance(value, bool) else default


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def diagnose_worker(w: Mapping[str, Any], slo: float | None = None) -> list[Finding]:
    """Findings about one worker's status dict."""
    name = str(w.get("name", "?"))
    out: list[Finding] = []
    kv = _num(w, "kv_cache_usage")
    running, waiting = int(_num(w, "running")), int(_num(w, "waiting"))
    max_seqs = int(_num(w, "max_num_seqs")) or None
    pre = w.get("preemptions") if isinstance(w.get("preemptions"), Mapping) else {}
    n_recompute, n_swap = int(_num(pre, "recompute")), int(_num(pre, "swap"))
    rate = _num(w, "preemption_rate")
    batch = f"{running} running" + (f" of max_num_seqs {max_seqs}" if max_seqs else "")

    if kv >= KV_PRESSURE and (waiting or n_recompute + n_swap):
        groups = w.get("kv_blocks_by_group") or []
        by_group = (
            " (blocks held: " + ", ".join(f"{kind} {n}" for kind, n in groups) + ")"
            if len(groups) > 1
            else ""
        )
        out.append(
            Finding(
                "memory_pressure",
                name,
                f"memory pressure limits the batch: KV cache {kv:.0%} full{by_group}, {batch}, "
                f"{waiting} waiting, {n_recompute + n_swap} preemptions so far",
                "give the KV cache more memory (--kv-cache-memory, or --gpu-memory-utilization "
                "on a GPU), lower --max-model-len or the jobs' max_tokens, or add workers",
            )
        )
    elif waiting and (max_seqs is None or running < max_seqs):
        out.append(
            Finding(
                "not_admitted",
                name,
                f"{waiting} requests wait in the engine without being admitted although the "
                f"KV cache is only {kv:.0%} full ({batch})",
                "a long prompt waits for token budget: raise --max-num-batched-tokens (or keep "
                "chunked prefill on); swapped requests first need blocks to come back",
            )
        )
    if rate > HIGH_PREEMPTION_RATE:
        avg_swap = _num(w, "avg_swap_bytes")
        swap_text = f", average swap size {_mib(avg_swap)}" if n_swap else ""
        out.append(
            Finding(
                "preemption_rate",
                name,
                f"high preemption rate: {rate:.0%} of scheduled requests were preempted "
                f"({n_recompute} by recompute, {n_swap} by swap{swap_text})",
                "more KV memory (--kv-cache-memory), fewer concurrent sequences "
                "(--max-num-seqs), or a larger --swap-space so that preemption swaps",
            )
        )
    if slo is not None:
        queue_time = w.get("job_queue_time_s")
        if not isinstance(queue_time, int | float):
            queue_time = _num(w, "mean_queue_time_s")
        if queue_time > slo:
            out.append(
                Finding(
                    "queue_time",
                    name,
                    f"queue time {queue_time:.1f} s is above the SLO of {slo:g} s",
                    "add workers (replicas); lower --max-num-seqs for latency; give urgent jobs "
                    "a lower priority value",
                )
            )
    return out


def diagnose(
    workers: Iterable[Mapping[str, Any]],
    queue_lengths: Mapping[str, int],
    slo: float | None = None,
    now: float | None = None,
) -> list[Finding]:
    """Every finding, fleet-wide ones (idle workers while jobs wait) first."""
    now = time.time() if now is None else now
    live, out = [], []
    for w in workers:
        age = now - _num(w, "updated_at", now)
        if age > STALE_SECONDS:
            out.append(
                Finding(
                    "stale",
                    str(w.get("name", "?")),
                    f"no status for {age:.0f} s: the worker is gone or stuck",
                    "check the worker's process and logs; its jobs are re-run once their "
                    "leases expire (--lease-ttl)",
                )
            )
        else:
            live.append(w)
    queued = sum(queue_lengths.values())
    if queued:
        idle = [w for w in live if not _num(w, "in_flight") and not _num(w, "running")]
        if not live:
            out.append(
                Finding(
                    "idle",
                    None,
                    f"{queued} jobs wait in the queue and no worker is running",
                    "start workers: pagedq worker --queue NAME",
                )
            )
        elif idle:
            names = ", ".join(str(w.get("name", "?")) for w in idle)
            out.append(
                Finding(
                    "idle",
                    None,
                    f"admission: {queued} jobs wait in the queue while {len(idle)} worker(s) "
                    f"are idle ({names})",
                    "check that those workers listen on the jobs' queue (--queue) and serve the "
                    "model the jobs pin (--model); a worker admits only while its engine can "
                    "take a request (--max-num-seqs, KV blocks for the prompt)",
                )
            )
        full = [
            w
            for w in live
            if _num(w, "max_num_seqs") and _num(w, "running") >= _num(w, "max_num_seqs")
        ]
        if live and len(full) == len(live):
            out.append(
                Finding(
                    "capacity",
                    None,
                    f"{queued} jobs wait in the queue and every worker runs a full batch "
                    "(max_num_seqs)",
                    "add workers, or raise --max-num-seqs where the KV cache has room",
                )
            )
    for w in live:
        out.extend(diagnose_worker(w, slo))
    return out


def queue_lengths(redis: Redis, groups: Mapping[str, Iterable[str]]) -> dict[str, int]:
    """Jobs waiting in each queue: the RQ queues of its group (a sharded queue's shards)."""
    return {
        name: sum(Queue(q, connection=redis).count for q in dict.fromkeys(queues))
        for name, queues in groups.items()
    }


def collect(
    redis: Redis, queue: str, shard_names: Iterable[str] | None = None
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The workers' statuses and the length of ``queue`` (its ``shard_names`` summed, when it
    is sharded) and of every queue a worker serves (a sharded worker's shards as its queue)."""
    workers = read_worker_statuses(redis)
    groups: dict[str, list[str]] = {queue: list(shard_names or [queue])}
    for w in workers:
        served = [q for q in w.get("queues") or [w.get("queue")] if isinstance(q, str)]
        logical = w.get("queue")
        if isinstance(logical, str) and any(hash_tag(q) for q in served):
            groups.setdefault(logical, []).extend(served)
        else:
            for q in served:
                groups.setdefault(q, [q])
    return workers, queue_lengths(redis, groups)


def format_findings(findings: list[Finding], workers: list, lengths: Mapping[str, int]) -> str:
    """The report `pagedq diagnose` prints."""
    head = ", ".join(f"{name} {n} queued" for name, n in lengths.items())
    lines = [f"{head}; {len(workers)} worker(s) reporting"]
    if not findings:
        lines.append("nothing limits throughput: workers are busy within their memory")
    lines += [str(f) for f in findings]
    return "\n".join(lines)


def diagnose_command(args: argparse.Namespace) -> int:
    """`pagedq diagnose [--slo S] [--json]`: exit code 0 with no finding, else 3."""
    client = Client(args.redis_url, args.queue, queue_shards=args.queue_shards)
    workers, lengths = collect(client.redis, args.queue, client.shards.names)
    findings = diagnose(workers, lengths, args.slo)
    if args.json:
        print(json.dumps({"queues": lengths, "findings": [f.__dict__ for f in findings]}, indent=2))
    else:
        print(format_findings(findings, workers, lengths))
    return 3 if findings else 0
