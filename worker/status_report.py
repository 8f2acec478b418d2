"""The JSON status a worker publishes under ``pagedq:worker:{name}`` (read by status/diagnose/top).

A pure function of the engine's counters, so that producers can rely on the fields without
importing the worker. Every field is documented in docs/SCHEDULING.md ("Worker status").
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

STATUS_VERSION = 1

# Copied from config_summary to the top level when present (`pagedq status` reads model/queue).
CONFIG_TOP_LEVEL = ("model", "queue", "queues", "max_num_seqs", "max_num_batched_tokens")


def build_status(
    stats: Any, in_flight: int | Mapping[str, Any], config_summary: Mapping[str, Any]
) -> dict[str, Any]:
    """The status dict of one worker.

    ``stats``: an ``engine.EngineStats``. ``in_flight``: the number of started jobs, or the
    worker's map of them (items with ``enqueued_at`` and ``started_at``, as ``InFlight``), from
    which the mean time in the Redis queue of the jobs in flight is taken. ``config_summary``:
    the settings an operator would change (model, queue, max_num_seqs, kv_cache_memory,
    swap_space, scheduling_policy, tenant_weights, ...), published under ``config``.
    """
    if isinstance(in_flight, Mapping):
        num_in_flight = len(in_flight)
        waits = [
            item.started_at - item.enqueued_at
            for item in in_flight.values()
            if getattr(item, "enqueued_at", None) and getattr(item, "started_at", None)
        ]
        job_queue_time = sum(waits) / len(waits) if waits else None
    else:
        num_in_flight, job_queue_time = int(in_flight), None
    num_swap = getattr(stats, "num_preemptions_swap", 0)
    num_scheduled = getattr(stats, "num_scheduled_requests", 0)
    status: dict[str, Any] = {
        "version": STATUS_VERSION,
        "in_flight": num_in_flight,
        "running": stats.num_running,
        "waiting": stats.num_waiting,
        "swapped": getattr(stats, "num_swapped", 0),
        "kv_cache_usage": round(stats.kv_cache_usage, 4),
        "num_blocks": stats.num_blocks,
        "num_free_blocks": stats.num_free_blocks,
        "preemptions": {
            "recompute": getattr(stats, "num_preemptions_recompute", stats.num_preemptions),
            "swap": num_swap,
        },
        "preemption_rate": round(stats.num_preemptions / num_scheduled, 4) if num_scheduled else 0,
        "swapped_out_bytes": getattr(stats, "swapped_out_bytes", 0),
        "avg_swap_bytes": (
            int(getattr(stats, "swapped_out_bytes", 0) / num_swap) if num_swap else 0
        ),
        "swap_space_usage": round(getattr(stats, "swap_space_usage", 0.0), 4),
        "mean_queue_time_s": round(getattr(stats, "mean_queue_time_s", 0.0), 4),
        "job_queue_time_s": round(job_queue_time, 4) if job_queue_time is not None else None,
        "generation_tokens_per_s": round(getattr(stats, "generation_tokens_per_s", 0.0), 2),
        "prefill_tokens_per_s": round(getattr(stats, "prefill_tokens_per_s", 0.0), 2),
        "tenant_generated_tokens": dict(getattr(stats, "tenant_generated_tokens", {})),
        "prefix_cache_hit_rate": round(stats.prefix_cache_hit_rate, 4),
        "num_steps": stats.num_steps,
        "num_generated_tokens": stats.num_generated_tokens,
        "num_scheduled_requests": num_scheduled,
        "config": dict(config_summary),
        "updated_at": time.time(),
    }
    for key in CONFIG_TOP_LEVEL:
        if key in config_summary:
            status[key] = config_summary[key]
    return status
