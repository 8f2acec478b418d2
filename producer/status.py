"""What `pagedq status` reports: queue depth, RQ registry counts, pagedq workers."""

from __future__ import annotations

import json
import time
from typing import Any

from redis import Redis
from rq import Queue

from producer.client import Client
from producer.contract.keys import WORKER_KEY_PATTERN, rq_workers_of_key, worker_key


def read_worker_statuses(redis: Redis) -> list[dict[str, Any]]:
    """Every worker's last published status (see worker/status_report.py), with its ``name``."""
    workers = []
    for key in sorted(redis.scan_iter(match=WORKER_KEY_PATTERN, count=500)):
        raw = redis.get(key)
        if raw is None:
            continue
        try:
            info = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(info, dict):
            continue
        info["name"] = key.decode().removeprefix(worker_key(""))
        workers.append(info)
    return workers


def queue_status(client: Client) -> dict[str, Any]:
    """Counts from RQ's queue and registries, plus each worker's last pagedq heartbeat; a
    sharded queue's counts are its shards' together."""
    counts = dict.fromkeys(("queued", "started", "finished", "failed", "canceled", "scheduled"), 0)
    rq_workers: set[bytes] = set()
    for name in client.shards.names:
        q = Queue(name, connection=client.redis, serializer=client.queue.serializer)
        counts["queued"] += q.count
        for registry in ("started", "finished", "failed", "canceled", "scheduled"):
            counts[registry] += getattr(q, f"{registry}_job_registry").get_job_count(cleanup=False)
        rq_workers |= client.redis.smembers(rq_workers_of_key(name))
    workers = read_worker_statuses(client.redis)
    return {
        "queue": client.queue.name,
        "counts": counts,
        "rq_workers": len(rq_workers),
        "workers": workers,
    }


def format_status(status: dict[str, Any]) -> str:
    """A human-readable table of `queue_status`."""
    lines = [f"queue {status['queue']}"]
    lines += [f"  {name:<10}{n:>8}" for name, n in status["counts"].items()]
    workers = status["workers"]
    lines.append(f"workers: {len(workers)} pagedq, {status['rq_workers']} registered with RQ")
    if workers:
        lines.append(
            f"  {'name':<28}{'in_flight':>10}{'running':>9}{'waiting':>9}{'kv':>7}  model  age"
        )
    for w in workers:
        kv = w.get("kv_cache_usage")
        kv_text = f"{kv:.0%}" if isinstance(kv, int | float) else "-"
        age = w.get("updated_at")
        age_text = f"{time.time() - age:.0f}s" if isinstance(age, int | float) else "-"
        lines.append(
            f"  {w['name']:<28}{w.get('in_flight', '-')!s:>10}{w.get('running', '-')!s:>9}"
            f"{w.get('waiting', '-')!s:>9}{kv_text:>7}  {w.get('model', '-')}  {age_text}"
        )
    return "\n".join(lines)
