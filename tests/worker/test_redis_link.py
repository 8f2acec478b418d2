"""RedisLink against a real redis-server that goes away and comes back (no model)."""

from __future__ import annotations

import time

import pytest

from producer.client import Client
from producer.retry import redact_url
from worker.redis_link import Command, RedisLink, connect
from worker.redis_server import PrivateRedis
from worker.rq_adapter import RQAdapter


@pytest.fixture
def server():
    with PrivateRedis(appendonly=True) as s:
        yield s


def test_writes_made_while_redis_is_down_are_buffered_then_written_in_order(server):
    link = RedisLink(connect(server.url))
    replies: list = []
    server.kill()
    link.run([Command("RPUSH", ["order", "a"])], replies.append)
    link.run([Command("RPUSH", ["order", "b"]), Command("RPUSH", ["order", "c"])], replies.append)
    assert not link.up and len(link.outbox) == 2 and replies == []
    assert link.attempt(lambda: link.scripts.connection.ping()) == (False, None)

    link._next_attempt_at = 0.0
    assert link.poll() is False  # still down: one more logged attempt
    server.start()
    link._next_attempt_at = 0.0
    assert link.poll() is True
    assert server.client().lrange("order", 0, -1) == [b"a", b"b", b"c"]
    assert replies == [[1], [2, 3]] and not link.outbox


def test_fenced_scripts_run_again_after_a_restart_emptied_the_script_cache(server):
    connection = connect(server.url)
    Client(connection=server.client(), queue="q").submit(prompt="hi")
    adapter = RQAdapter(connection, "w", ["q"], lease_ttl=5, result_ttl=5, stream_ttl=5,
                        max_crashes=2)  # fmt: skip
    link = RedisLink(connection)
    call, started_at = adapter.dequeue_call()
    [claim] = adapter.claims(link.scripts.call(call), started_at)
    server.restart()  # AOF keeps the job; the script cache is empty now
    result = f'{{"job_id": "{claim.job_id}", "status": "finished"}}'
    link.run([adapter.end_call(claim, "finished", result, (0, 0), {"event": "done"})])
    assert server.client().hget(f"rq:job:{claim.job_id}", "status") == b"finished"


def test_a_batch_of_commands_then_one_script_needs_no_multi_and_two_scripts_do(server):
    """Idempotent commands then one script go as a plain pipeline (run again whole after a
    cut, it is what MULTI would have made of it); a batch with two scripts, or a command after
    its script, runs in one MULTI/EXEC."""
    from redis_monitor import CommandLog

    from producer.contract.lua import LuaScript
    from worker.redis_link import ScriptCall

    push = LuaScript("push", keys=("list",), args=("value",), body=(
        "return redis.call('RPUSH', k_list, a_value)"))  # fmt: skip
    runner = RedisLink(connect(server.url)).scripts
    log = CommandLog(server.client())

    def script(value: str) -> ScriptCall:
        return ScriptCall(push, *push.keys_and_args({"list": "l"}, {"value": value}))

    assert runner.run([Command("SET", ["k", "v"]), script("a")]) == [True, 1]
    assert log.words("multi") == []
    assert runner.run([script("b"), script("c")]) == [2, 3]
    assert runner.run([script("d"), Command("GET", ["k"])]) == [4, b"v"]
    deadline = time.monotonic() + 5
    while len(log.words("exec")) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(log.words("multi")) == len(log.words("exec")) == 2
    assert server.client().lrange("l", 0, -1) == [b"a", b"b", b"c", b"d"]


@pytest.mark.parametrize(
    "url, shown",
    [
        ("redis://user:pw@host:6379/0", "redis://user:***@host:6379/0"),
        ("rediss://:pw@host/1", "rediss://:***@host/1"),
        ("redis://host:6379/0", "redis://host:6379/0"),
        (
            "rediss://:pw@h/0?ssl_ca_certs=/ca.pem&ssl_password=k",
            "rediss://:***@h/0?ssl_ca_certs=/ca.pem&ssl_password=***",
        ),
    ],
)
def test_urls_are_logged_without_their_password(url, shown):
    assert redact_url(url) == shown
