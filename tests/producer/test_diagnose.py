"""`pagedq diagnose` and `pagedq top --once` on worker statuses written to a real redis-server."""

from __future__ import annotations

import json
import time

from engine.llm_engine import EngineStats
from producer.cli import main
from producer.client import Client
from producer.contract.keys import worker_key
from worker.status import build_status

QUEUE = "diag"


def stats(**kw) -> EngineStats:
    base = dict(
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.0,
        num_free_blocks=100,
        num_blocks=100,
        num_preemptions=0,
        num_chunked_prefills=0,
        prefix_cache_hit_rate=0.0,
        num_steps=0,
        num_prompt_tokens=0,
        num_generated_tokens=0,
    )
    return EngineStats(**{**base, **kw})


def publish(redis, name: str, engine_stats: EngineStats, in_flight: int = 0, **config) -> dict:
    config = {"model": "smollm2", "queue": QUEUE, "max_num_seqs": 64, **config}
    status = build_status(engine_stats, in_flight, config)
    redis.set(worker_key(name), json.dumps(status))
    return status


def run(capsys, redis_server, *argv: str) -> tuple[int, str]:
    code = main([*argv, "--redis-url", redis_server.url, "--queue", QUEUE])
    return code, capsys.readouterr().out


def test_status_fields_of_a_worker_under_memory_pressure():
    s = build_status(
        stats(
            num_running=3,
            num_waiting=9,
            kv_cache_usage=0.97,
            num_preemptions=12,
            num_preemptions_recompute=4,
            num_preemptions_swap=8,
            swapped_out_bytes=8 * 3 * 2**20,
            num_swapped=2,
            num_scheduled_requests=40,
            tenant_generated_tokens={"a": 10},
        ),
        12,
        {"model": "m", "queue": QUEUE, "max_num_seqs": 64},
    )
    assert s["preemptions"] == {"recompute": 4, "swap": 8}
    assert s["avg_swap_bytes"] == 3 * 2**20
    assert s["preemption_rate"] == 0.3
    assert (s["in_flight"], s["running"], s["waiting"], s["swapped"]) == (12, 3, 9, 2)
    assert s["model"] == "m" and s["max_num_seqs"] == 64 and s["config"]["queue"] == QUEUE
    assert s["tenant_generated_tokens"] == {"a": 10}
    json.dumps(s)  # plain JSON


def test_diagnose_names_memory_pressure(redis_server, redis_client, capsys):
    publish(
        redis_client,
        "gpu-1",
        stats(
            num_running=3,
            num_waiting=9,
            kv_cache_usage=0.97,
            num_preemptions=2,
            num_preemptions_recompute=2,
            num_scheduled_requests=40,
        ),
        in_flight=12,
    )
    code, out = run(capsys, redis_server, "diagnose")
    assert code == 3
    assert "[gpu-1] memory pressure limits the batch: KV cache 97% full" in out
    assert "--kv-cache-memory" in out
    assert "admission" not in out and "preemption rate" not in out


def test_diagnose_gives_the_blocks_of_each_layer_group(redis_server, redis_client, capsys):
    groups = [("full_attention", 120), ("sliding_window=512", 24)]
    status = publish(
        redis_client,
        "gpu-2",
        stats(num_running=3, num_waiting=9, kv_cache_usage=0.97, kv_blocks_by_group=groups),
    )
    assert status["kv_blocks_by_group"] == [["full_attention", 120], ["sliding_window=512", 24]]
    _, out = run(capsys, redis_server, "diagnose")
    assert "KV cache 97% full (blocks held: full_attention 120, sliding_window=512 24)" in out


def test_diagnose_names_admission_for_an_idle_worker_and_a_full_queue(
    redis_server, redis_client, capsys
):
    Client(redis_server.url, QUEUE).submit_many([{"prompt": f"p{i}"} for i in range(5)])
    publish(redis_client, "idle-1", stats())
    publish(redis_client, "busy-1", stats(num_running=4, kv_cache_usage=0.5), in_flight=4)
    code, out = run(capsys, redis_server, "diagnose")
    assert code == 3
    assert "admission: 5 jobs wait in the queue while 1 worker(s) are idle (idle-1)" in out
    assert "--queue" in out and "--model" in out
    assert "memory pressure" not in out


def test_diagnose_preemption_rate_with_swap_size_and_slo(redis_server, redis_client, capsys):
    publish(
        redis_client,
        "w",
        stats(
            num_running=8,
            kv_cache_usage=0.5,
            num_preemptions=10,
            num_preemptions_swap=10,
            swapped_out_bytes=10 * 5 * 2**20,
            num_scheduled_requests=20,
            mean_queue_time_s=12.0,
        ),
        in_flight=8,
    )
    code, out = run(capsys, redis_server, "diagnose", "--slo", "5")
    assert "high preemption rate: 50% of scheduled requests were preempted" in out
    assert "average swap size 5.0 MiB" in out
    assert "queue time 12.0 s is above the SLO of 5 s" in out
    code, out = run(capsys, redis_server, "diagnose", "--slo", "30", "--json")
    kinds = [f["kind"] for f in json.loads(out)["findings"]]
    assert kinds == ["preemption_rate"]


def test_diagnose_healthy_and_stale(redis_server, redis_client, capsys):
    publish(redis_client, "ok", stats(num_running=8, kv_cache_usage=0.5), in_flight=8)
    code, out = run(capsys, redis_server, "diagnose")
    assert code == 0 and "nothing limits throughput" in out
    old = json.loads(redis_client.get(worker_key("ok")))
    old["updated_at"] = time.time() - 600
    redis_client.set(worker_key("ok"), json.dumps(old))
    code, out = run(capsys, redis_server, "diagnose")
    assert code == 3 and "[ok] no status for 600 s" in out


def test_top_once_prints_queues_tenants_and_every_worker(redis_server, redis_client, capsys):
    Client(redis_server.url, QUEUE).submit_many([{"prompt": "x"}] * 3)
    publish(
        redis_client,
        "gpu-a",
        stats(
            num_running=2,
            kv_cache_usage=0.42,
            tenant_generated_tokens={"team-a": 300, "team-b": 100},
        ),
        in_flight=2,
    )
    publish(
        redis_client,
        "gpu-b",
        stats(num_running=1, kv_cache_usage=0.1, tenant_generated_tokens={"team-b": 200}),
        in_flight=1,
    )
    code, out = run(capsys, redis_server, "top", "--once")
    assert code == 0
    assert "gpu-a" in out and "gpu-b" in out and "42%" in out
    assert "team-a" in out and "team-b" in out and "50%" in out  # 300 of 600 tokens each
    assert f"{QUEUE}" in out and " 3 " in out


def test_diagnose_names_capacity_when_every_batch_is_full(redis_server, redis_client, capsys):
    Client(redis_server.url, QUEUE).submit_many([{"prompt": "x"}] * 2)
    publish(redis_client, "full", stats(num_running=4, kv_cache_usage=0.5), 4, max_num_seqs=4)
    code, out = run(capsys, redis_server, "diagnose")
    assert code == 3
    assert "2 jobs wait in the queue and every worker runs a full batch" in out
    assert "add workers" in out


def test_a_sharded_queue_counts_as_one_in_diagnose_and_top(redis_server, redis_client, capsys):
    client = Client(redis_server.url, QUEUE, queue_shards=3)
    client.submit_many([{"prompt": f"p{i}"} for i in range(7)])
    assert sum(client.redis.llen(f"rq:queue:{name}") for name in client.shards.names) == 7
    # A worker serving the shards publishes its queue and the shards' names.
    publish(redis_client, "sharded", stats(), queues=client.shards.names)
    code, out = run(capsys, redis_server, "diagnose", "--queue-shards", "3", "--json")
    assert json.loads(out)["queues"] == {QUEUE: 7}
    code, out = run(capsys, redis_server, "diagnose", "--queue-shards", "3")
    assert code == 3 and out.startswith(f"{QUEUE} 7 queued;")
    assert "7 jobs wait in the queue while 1 worker(s) are idle (sharded)" in out
    # Without --queue-shards the worker's status still groups its shards under its queue.
    _, out = run(capsys, redis_server, "diagnose", "--json")
    assert json.loads(out)["queues"] == {QUEUE: 7}
    code, out = run(capsys, redis_server, "top", "--once", "--queue-shards", "3")
    assert code == 0 and f"{QUEUE}" in out and " 7 " in out and "{" not in out
