"""Redis Cluster: one logical queue split over three hash-tagged shards on three primaries, two
real workers, a producer on a redis+cluster:// URL; priorities and tenants across shards; a
primary SIGKILLed mid-run, and every job still ends exactly once."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from redis_cluster import RedisCluster, wait_until
from worker_process import WorkerProcess

from producer.client import Client
from producer.connection import redis_client
from producer.contract.keys import (
    batch_counts_key,
    cancel_key,
    events_key,
    fair_key,
    result_key,
    rq_job_key,
    rq_queue_key,
    rq_registry_key,
    rq_results_key,
    rq_wip_key,
    stream_key,
    subqueue_index_key,
    tenant_tokens_key,
    wake_key,
    weights_key,
)
from producer.contract.routing import model_queue, subqueue_name
from producer.contract.shards import QueueShards, shard_name, slot_of
from producer.errors import JobCanceledError
from worker.claim import Claim
from worker.redis_link import Command, ScriptCall, ScriptRunner, SplitCall
from worker.rq_adapter import MAX_PEEKS, RQAdapter

QUEUE = "q-cluster"
SHARDS = 3
LEASE_TTL = 10  # longer than a failover (2 s node timeout, the vote, the reconnect)
# A pause after each dequeue call: the failover test's run lasts past the kill.
THROTTLE = {"PAGEDQ_TEST_SLEEP_AFTER_DEQUEUE": "0.03", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def cluster():
    with RedisCluster() as c:
        yield c


@pytest.fixture(scope="module")
def workers(cluster, tiny_llama_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("cluster-workers")
    procs = [
        # RQ's result stream on every job: one entry per end, the witness of "ended once".
        WorkerProcess(cluster.url, QUEUE, f"w-cluster-{i}", log_dir, "--rq-results", "all",
                      "--queue-shards", str(SHARDS), model=tiny_llama_dir, lease_ttl=LEASE_TTL,
                      env=THROTTLE)
        for i in range(2)
    ]  # fmt: skip
    try:
        for w in procs:
            w.wait_ready(timeout=300)
        yield procs
    finally:
        for w in procs:
            w.stop(timeout=20)


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.url, QUEUE, queue_shards=SHARDS, check_interval=0.5) as c:
        yield c


def _jobs(n: int, tag: str) -> list[dict]:
    return [
        {"prompt": f"{tag} {i}: say something", "max_tokens": 1 + i % 2, "temperature": 0}
        for i in range(n)
    ]


def _finished(connection, shards: QueueShards) -> int:
    return sum(connection.zcard(rq_registry_key("finished", q)) for q in shards.names)


def _assert_ended_once(client: Client, job_ids: list[str]) -> None:
    shards = client.shards
    results = [client.result(j, timeout=180) for j in job_ids]
    assert Counter(r.status for r in results) == {"finished": len(job_ids)}
    assert all(r.usage.completion_tokens >= 1 and r.text is not None for r in results)
    pipe = client.redis.pipeline(transaction=False)
    for j in job_ids:
        pipe.xlen(rq_results_key(j))
    # One RQ result entry per job: no job ended twice (a replayed END is fenced).
    assert Counter(pipe.execute()) == {1: len(job_ids)}
    members = set()
    for q in shards.names:
        members |= {m.decode() for m in client.redis.zrange(rq_registry_key("finished", q), 0, -1)}
        assert client.redis.zcard(rq_registry_key("failed", q)) == 0
    assert set(job_ids) <= members


# --- the contract: every key of a shard in one slot ---------------------------------------------


def test_every_key_a_shards_scripts_touch_hashes_to_its_slot():
    shards = QueueShards(QUEUE, SHARDS)
    for i, shard in enumerate(shards.names):
        job_id, placed = shards.place(f"job-{i}")
        assert placed == shard or shards.name(shards.index(f"job-{i}")) == placed
        job_id = shard + "pq-0123"  # a job of this shard
        base = model_queue(shard, "smollm2")
        sub = subqueue_name(base, 5, "acme")
        keys = [
            rq_queue_key(shard), rq_queue_key(base), rq_queue_key(sub), rq_wip_key(sub),
            rq_registry_key("finished", sub), rq_registry_key("failed", shard),
            rq_registry_key("canceled", base), subqueue_index_key(base), fair_key(sub),
            weights_key(base), tenant_tokens_key(sub), rq_job_key(job_id), result_key(job_id),
            stream_key(job_id), cancel_key(job_id), rq_results_key(job_id),
            batch_counts_key(shard_name(shard, "batch_1")), events_key(shard_name(shard, "n1")),
            wake_key(shard_name(shard, "hub1")),
        ]  # fmt: skip
        assert {slot_of(k) for k in keys} == {slot_of(shard)}, keys
    # The shards' tags sit in the 1st, 2nd and 3rd thirds of the slots: one per primary of an
    # evenly split three-primary cluster.
    assert [slot_of(n) * SHARDS // 16384 for n in shards.names] == list(range(SHARDS))


def _claims(shards: QueueShards) -> list[Claim]:
    out = []
    for i in range(9):
        job_id, queue = shards.place(f"c{i}")
        out.append(Claim(job_id, queue, f"e{i}", 1, b"", "", "", False))
    return out


def test_every_script_call_declares_keys_of_one_slot():
    """The calls a worker makes about jobs of three shards: each script names its keys, all
    in one slot (a cluster refuses the others with CROSSSLOT; one with no keys is refused)."""
    shards = QueueShards(QUEUE, SHARDS)
    queues = [q for s in shards.names for q in (model_queue(s, "m"), s)]
    adapter = RQAdapter(None, "w", queues, lease_ttl=10, result_ttl=60, stream_ttl=60,
                        max_crashes=2)  # fmt: skip
    adapter.all_queues = lambda: queues  # RQ's set of queues would list the sub-queues too
    claims = _claims(shards)
    ends = [adapter.end_call(c, "finished", "{}", (1, 1), {}) for c in claims]
    dequeue = adapter.dequeue_call(4)[0]
    best_second = [[b"3"], [b"0"], []]  # PEEK replies: shard 1 has the best head
    calls = [
        dequeue,
        dequeue.then(best_second),
        *adapter.merge_ends(ends),
        adapter.requeue_call(claims[0], count_crash=True, result_json="{}", reason="x"),
        adapter.stream_call([(c, {"event": "token"}, True) for c in claims]),
        adapter.heartbeat_call(claims, "busy"),
        adapter.reap_call(),
        adapter.cancel_check([c.job_id for c in claims]),
    ]
    scripts = set()
    for call in calls:
        parts = call.parts if isinstance(call, SplitCall) else [call]
        for part in parts:
            if isinstance(part, Command):
                keys = part.args[:1] if part.name != "MGET" else part.args
            else:
                assert isinstance(part, ScriptCall) and part.keys, part
                scripts.add(part.script.name)
                keys = part.keys
            assert len({slot_of(k) for k in keys}) == 1, (part, keys)
    assert scripts == {"peek", "dequeue", "end", "requeue", "stream", "heartbeat", "reap"}
    assert dequeue.then(best_second).args[-1] == 3.0  # takes from shard 1 down to priority 3
    assert dequeue.then([[], [], []]) is None
    # The calls about jobs of every shard are one script per shard.
    [merged] = adapter.merge_ends(ends)
    assert isinstance(merged, SplitCall) and len(merged.parts) == SHARDS


def test_a_dequeue_over_many_shards_asks_a_rotating_few():
    shards = QueueShards(QUEUE, 6)
    adapter = RQAdapter(None, "w", shards.names, lease_ttl=10, result_ttl=60, stream_ttl=60,
                        max_crashes=2)  # fmt: skip
    asked = []
    for _ in range(3):
        call = adapter.dequeue_call(4)[0]
        asked.append([part.keys[0] for part in call.parts])
    assert [len(a) for a in asked] == [MAX_PEEKS] * 3
    assert [a[0] for a in asked] == [rq_queue_key(shards.name(i)) for i in range(3)]
    assert {k for a in asked for k in a} == {rq_queue_key(n) for n in shards.names}


# --- a real cluster ---------------------------------------------------------------------------


def test_the_shards_of_one_queue_land_on_three_primaries(cluster):
    owners = {cluster.primary_of(name) for name in QueueShards(QUEUE, SHARDS).names}
    assert len(owners) == SHARDS == len(cluster.primaries())


def test_two_thousand_jobs_over_three_primaries_end_exactly_once(cluster, workers, client):
    t0 = time.monotonic()
    job_ids = client.submit_many(_jobs(2000, "bulk"))
    assert len(set(job_ids)) == 2000
    per_shard = Counter(QueueShards(QUEUE, SHARDS).names.index(j[: j.index("}") + 1])
                        for j in job_ids)  # fmt: skip
    assert min(per_shard.values()) > 2000 / SHARDS * 0.85, per_shard
    # Re-enqueueing the same requests under custom ids is idempotent, shard and all.
    again = client.submit_many({**j, "custom_id": f"c{i}"} for i, j in enumerate(_jobs(5, "x")))
    assert client.submit_many({**j, "custom_id": f"c{i}"}
                              for i, j in enumerate(_jobs(5, "x"))) == again  # fmt: skip
    _assert_ended_once(client, job_ids + again)
    # Both workers took part, from every shard.
    ended = Counter()
    for w in workers:
        log = w.log_tail(10_000_000)
        for i, name in enumerate(QueueShards(QUEUE, SHARDS).names):
            ended[(w.name, i)] = log.count(f"job_id={name}")
    assert all(n > 0 for n in ended.values()), ended
    print(f"2,005 jobs in {time.monotonic() - t0:.1f} s; per worker and shard: {dict(ended)}")


def test_a_streamed_job_and_a_cancel(client, workers):
    job_id = client.submit(prompt="stream across the cluster", max_tokens=8, temperature=0)
    text = "".join(client.stream(job_id, timeout=60))
    assert text == client.result(job_id).text and text
    with workers[0].paused(), workers[1].paused():  # nothing is dequeued meanwhile
        queued = client.submit(prompt="never runs", max_tokens=4, custom_id="cancel-me")
        assert client.cancel(queued) is True
    # RQ's cancel and the canceled result, in the job's shard (one WATCH/MULTI slot).
    with pytest.raises(JobCanceledError):
        client.result(queued, timeout=10)
    time.sleep(1.0)
    assert client.status(queued) == "canceled"


# --- priorities and tenants across shards (the real dequeue script, no engine) ----------------

FAIR_QUEUE = "q-cluster-fair"
ROOM = 4  # jobs per dequeue call, as a worker with room for 4


def _drain(adapter: RQAdapter, runner: ScriptRunner, count: int) -> list[Claim]:
    taken: list[Claim] = []
    while len(taken) < count:
        call, t = adapter.dequeue_call(ROOM)
        claims = adapter.claims(runner.call(call), t)
        if not claims:
            break
        taken += claims
    return taken


@pytest.fixture(params=["cluster", "one-redis"])
def fair(request):
    """A producer and a bare dequeuer on a queue of three shards no worker serves, on the
    cluster and on one Redis (the same shards, the same scripts)."""
    if request.param == "cluster":
        url = request.getfixturevalue("cluster").url
    else:
        url = request.getfixturevalue("redis_server").url
    connection = redis_client(url)
    shards = QueueShards(FAIR_QUEUE, SHARDS, tagged=request.param == "cluster")
    adapter = RQAdapter(connection, "fair", shards.names, lease_ttl=600, result_ttl=60,
                        stream_ttl=60, max_crashes=2)  # fmt: skip
    with Client(url, FAIR_QUEUE, queue_shards=SHARDS) as producer:
        assert producer.shards == shards
        yield producer, adapter, ScriptRunner(connection)
    for name in shards.names:
        connection.delete(rq_queue_key(name), fair_key(name), weights_key(name))


def test_priority_across_shards_within_one_call_per_other_shard(fair):
    producer, adapter, runner = fair
    low = producer.submit_many({"prompt": f"low {i}", "max_tokens": 4, "priority": 5}
                               for i in range(150))  # fmt: skip
    urgent = set(producer.submit_many({"prompt": f"urgent {i}", "max_tokens": 4}
                                      for i in range(30)))  # fmt: skip
    order = [c.job_id for c in _drain(adapter, runner, 180)]
    assert sorted(order) == sorted([*low, *urgent])
    last_urgent = max(i for i, j in enumerate(order) if j in urgent)
    inversions = sum(1 for j in order[:last_urgent] if j not in urgent)
    # One Redis: 0. Across shards a dequeue takes from one shard, so a shard out of urgent jobs
    # may hand out low ones while another still has urgent ones: at most one call's worth per
    # other shard.
    print(f"priority inversions across {SHARDS} shards: {inversions} of {len(order)}")
    assert inversions <= (SHARDS - 1) * ROOM


def test_tenant_shares_follow_weights_across_shards(fair):
    producer, adapter, runner = fair
    adapter.set_tenant_weights({"A": 1, "B": 3})
    reqs = [{"prompt": "x" * 40, "max_tokens": 10, "tenant": t} for _ in range(150) for t in "AB"]
    ids = producer.submit_many(reqs)
    tenant = dict(zip(ids, (r["tenant"] for r in reqs), strict=True))
    first = _drain(adapter, runner, 120)  # both backlogged all along
    share_b = Counter(tenant[c.job_id] for c in first[:120])["B"] / 120
    print(f"tenant B's share at weights 1:3 across {SHARDS} shards: {share_b:.3f} (0.75 wanted)")
    assert abs(share_b - 0.75) <= 0.075
    late = producer.submit_many({"prompt": "x" * 40, "max_tokens": 10, "tenant": "C"}
                                for _ in range(6))  # fmt: skip
    got = [c.job_id for c in _drain(adapter, runner, SHARDS * ROOM)]
    # A tenant arriving late is served at once on every shard it waits in, not after the
    # backlog: within one call per shard.
    shard = lambda job_id: job_id[: job_id.index("}") + 1]  # noqa: E731
    assert {shard(j) for j in late} == {shard(j) for j in got if j in set(late)}


# --- the gateway ------------------------------------------------------------------------------


def test_a_gateway_batch_and_a_streamed_chat_complete_on_the_cluster(cluster, workers, tmp_path):
    sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))
    from gw_helpers import KEYS, GatewayProcess, batch_file, chat_line, wait_batch

    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    gw = GatewayProcess(cluster.url, tmp_path, keys_file, "--queue", QUEUE,
                        "--queue-shards", str(SHARDS))  # fmt: skip
    try:
        oai = gw.openai()
        lines = [chat_line(f"row-{i}", f"Tell me about {i}.", max_tokens=3) for i in range(12)]
        lines.append(chat_line("bad-body", "x", max_tokens=0))  # a 400 line: the error file
        uploaded = oai.files.create(file=("in.jsonl", batch_file(lines)), purpose="batch")
        batch = oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                   completion_window="24h")  # fmt: skip
        done = wait_batch(oai, batch.id, ("completed", "failed"))
        assert done.status == "completed", done
        counts = done.request_counts
        assert (counts.total, counts.completed, counts.failed) == (13, 12, 1)
        out = [json.loads(x) for x in oai.files.content(done.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in out) == sorted(f"row-{i}" for i in range(12))
        usage = sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out)
        assert done.usage.output_tokens == usage > 0
        # Its lines were spread over the shards, each counted in its own shard's slot.
        ids = {x["response"]["body"]["id"].removeprefix("chatcmpl-") for x in out}
        assert len({j[: j.index("}") + 1] for j in ids}) > 1, ids
        chunks = oai.chat.completions.create(
            model="pagedq", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
            temperature=0, stream=True,
        )  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text
    finally:
        gw.stop()


def test_pagedq_submit_and_status_on_the_cluster(cluster, workers, tmp_path):
    lines = [{"custom_id": f"s{i}", "prompt": f"line {i}", "max_tokens": 2} for i in range(40)]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cli = [sys.executable, "-m", "pagedq_cli"]
    common = ["--redis-url", cluster.url, "--queue", QUEUE, "--queue-shards", str(SHARDS)]
    repo = Path(__file__).parents[2]
    run = subprocess.run([*cli, "submit", str(src), "-o", str(out), "--no-progress", *common],
                         capture_output=True, text=True, timeout=300, cwd=repo)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in rows) == sorted(x["custom_id"] for x in lines)
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in rows), rows
    status = subprocess.run([*cli, "status", "--json", *common], capture_output=True, text=True,
                            timeout=60, cwd=repo)  # fmt: skip
    assert status.returncode == 0, status.stderr[-3000:]
    report = json.loads(status.stdout)
    assert report["counts"]["queued"] == 0 and report["counts"]["finished"] >= 40
    assert report["rq_workers"] == 2 and len(report["workers"]) == 2


# --- failover: a primary SIGKILLed mid-run -----------------------------------------------------


def test_a_primary_killed_mid_run_loses_nothing_and_ends_nothing_twice(cluster, workers, client):
    pids = [w.process.pid for w in workers]
    shards = client.shards
    before = _finished(client.redis, shards)
    job_ids = client.submit_many(_jobs(1000, "failover"))
    wait_until(lambda: _finished(client.redis, shards) >= before + 100, 120, "100 jobs to end")
    victim = cluster.primary_of(shards.name(1))
    at_kill = _finished(client.redis, shards) - before
    cluster.kill(victim)
    assert at_kill < 900, "the jobs ran too fast: the kill came after them"
    cluster.wait_failover(victim)
    _assert_ended_once(client, job_ids)
    # The same processes serve on.
    extra = client.submit_many(_jobs(30, "after"))
    _assert_ended_once(client, extra)
    assert [w.process.poll() for w in workers] == [None, None]
    assert [w.process.pid for w in workers] == pids
    print(f"killed primary {victim} after {at_kill} of 1,000 jobs had ended")
