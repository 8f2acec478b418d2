"""min_replicas_ack: an enqueue ends with WAIT on its own connection; too few replicas is a
clear ReplicaAckError, and the jobs stay queued on the primary."""

from __future__ import annotations

import pytest
from sentinel_cluster import FAST_SYNC, replica_args, replica_in_sync, wait_until

from producer.cli import main
from producer.client import Client
from producer.contract.keys import rq_job_key, rq_queue_key
from producer.errors import ReplicaAckError
from producer.replica_ack import ReplicaAckedRedis
from worker.redis_server import PrivateRedis

QUEUE = "q-acked"


@pytest.fixture
def primary():
    with PrivateRedis(args=FAST_SYNC) as server:
        yield server


def test_an_enqueue_waits_for_the_replica_and_fails_clearly_without_it(primary):
    replica = PrivateRedis(args=replica_args(primary.port))
    try:
        wait_until(lambda: replica_in_sync(replica), 20, "the replica to sync")
        client = Client(primary.url, QUEUE, min_replicas_ack=1, replica_ack_timeout_ms=2000)
        job_ids = client.submit_many({"prompt": f"p{i}", "max_tokens": 2} for i in range(20))
        # Acknowledged means the replica has them already.
        on_replica = replica.client()
        assert all(on_replica.exists(rq_job_key(j)) for j in job_ids)

        replica.kill()
        wait_until(lambda: primary.client().info("replication")["connected_slaves"] == 0, 10,
                   "the primary to notice")  # fmt: skip
        slow = Client(primary.url, QUEUE, min_replicas_ack=1, replica_ack_timeout_ms=150)
        with pytest.raises(ReplicaAckError) as err:
            slow.submit(prompt="late", custom_id="late-1", max_tokens=2)
    finally:
        replica.close()
    message = str(err.value)
    assert "only 0 of 1 replica(s) acknowledged the enqueue within 150 ms" in message
    assert "ARE queued on the primary" in message and "lost" in message
    (job_id,) = err.value.job_ids
    # The job is queued on the primary all the same, and submitting it again is the same job.
    admin = primary.client()
    assert admin.hget(rq_job_key(job_id), "status") == b"queued"
    assert job_id.encode() in admin.lrange(rq_queue_key(QUEUE), 0, -1)
    assert Client(primary.url, QUEUE).submit(prompt="late", custom_id="late-1", max_tokens=2) == (
        job_id
    )
    assert admin.llen(rq_queue_key(QUEUE)) == 21


def test_no_replicas_asked_means_no_wait(primary):
    client = Client(primary.url, QUEUE)
    assert client.submit(prompt="x", max_tokens=2)
    assert client._writer is client.redis


def test_pagedq_submit_takes_the_flags_and_says_what_happened(primary, tmp_path, capsys):
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"custom_id": "a", "prompt": "hi", "max_tokens": 2}\n')
    out = tmp_path / "out.jsonl"
    code = main(["submit", str(lines), "-o", str(out), "--redis-url", primary.url, "--queue",
                 QUEUE, "--no-progress", "--min-replicas-ack", "1",
                 "--replica-ack-timeout-ms", "50"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1
    assert "only 0 of 1 replica(s) acknowledged the enqueue within 50 ms" in err
    assert "Traceback" not in err
    assert primary.client().llen(rq_queue_key(QUEUE)) == 1


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"min_replicas_ack": -1}, "min_replicas_ack must be an integer >= 0, got -1"),
        ({"min_replicas_ack": 1.5}, "min_replicas_ack must be an integer >= 0"),
        ({"replica_ack_timeout_ms": 0}, "replica_ack_timeout_ms must be an integer >= 1, got 0"),
    ],
)
def test_bad_settings_are_refused(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        Client("redis://127.0.0.1:1/0", **kwargs)


def test_bad_flags_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["submit", "in.jsonl", "-o", "out.jsonl", "--min-replicas-ack", "-2"])
    assert exit_.value.code == 2
    assert "--min-replicas-ack: must be an integer >= 0, got '-2'" in capsys.readouterr().err


def test_wait_refuses_to_run_inside_multi(primary):
    acked = ReplicaAckedRedis(primary.client(), replicas=1, timeout_ms=10)
    pipe = acked.pipeline(transaction=True)
    pipe.set("k", "v")
    with pytest.raises(TypeError, match="WAIT must follow EXEC"):
        pipe.execute()
