"""The gateway's StreamHub against a real redis-server and the worker's own scripts: the
entries of its jobs come inline in its wake stream (or, from workers that write job streams, it
reads only the streams listed there); a stream whose worker tells no hub is still read by its
periodic check."""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest

from gateway import stream_hub
from gateway.stream_hub import StreamHub
from producer.client import Client
from producer.contract.keys import result_key, stream_key
from producer.contract.schema import GenerationRequest
from producer.results import is_final
from worker.redis_link import ScriptRunner
from worker.rq_adapter import RQAdapter

QUEUE = "hub-test"
DELTA = {"event": "delta", "delta": "x"}
DONE = {"event": "done", "status": "result"}


class XReads:
    """The stream keys each XREAD names, and the keys of each EXISTS, as Redis runs them
    (MONITOR)."""

    def __init__(self, redis) -> None:
        self.keys: list[list[str]] = []
        self.exists: list[str] = []
        self._monitor = redis.monitor()
        self._monitor.connection.send_command("MONITOR")
        self._monitor.connection.read_response()
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        try:
            for cmd in self._monitor.listen():
                words = cmd["command"].split()
                if words[0].lower() == "exists":
                    self.exists += words[1:]
                if words[0].lower() == "xread":
                    at = [w.lower() for w in words].index("streams") + 1
                    names = words[at:]
                    self.keys.append(names[: len(names) // 2])
        except Exception:  # the connection closed at the end of the test
            pass


def _worker(redis_client) -> tuple[RQAdapter, ScriptRunner]:
    adapter = RQAdapter(redis_client, "w-hub", [QUEUE], lease_ttl=30, result_ttl=600,
                        stream_ttl=600, max_crashes=2)  # fmt: skip
    return adapter, ScriptRunner(redis_client)


def _enqueue(redis_client, prompts: list[str], wake: str | None) -> list[str]:
    requests = [GenerationRequest.model_validate({"prompt": p}) for p in prompts]
    return Client(connection=redis_client, queue=QUEUE).enqueue(requests, wake=wake)


async def _next(follow, timeout: float = 5.0) -> dict:
    return await asyncio.wait_for(follow.entries.get(), timeout)


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "listed"])
def test_the_hub_reads_only_its_wake_stream_and_the_streams_listed_there(
    redis_client, redis_server, inline
):
    """Inline (the default): the entries come in the wake stream and no job stream is read or
    written. Listed (a hub id a worker writes job streams for): only the listed are read."""

    async def run() -> None:
        hub = StreamHub(redis_server.url, wake_id=None if inline else uuid.uuid4().hex)
        await hub.start()
        try:
            a, b, c = _enqueue(redis_client, ["a", "b", "c"], wake=hub.wake_id)
            follows = {j: hub.follow(j) for j in (a, b, c)}
            adapter, scripts = _worker(redis_client)
            call, started_at = adapter.dequeue_call(3)
            claims = {cl.job_id: cl for cl in adapter.claims(scripts.call(call), started_at)}
            await asyncio.sleep(0.5)  # the new follows' first reads, and the first check
            reads = XReads(redis_client)
            assert scripts.call(adapter.stream_call([(claims[a], DELTA, True)])) == []
            assert await _next(follows[a]) == DELTA
            end = adapter.end_call(claims[b], "finished", '{"status": "finished"}', (1, 1), DONE)
            assert scripts.call(end) == [1]
            assert is_final(await _next(follows[b]))
            await asyncio.sleep(0.3)
            assert follows[c].entries.empty() and follows[a].entries.empty()
            named = [key for keys in reads.keys for key in keys]
            if inline:
                assert not any(k.startswith(stream_key("")) for k in named), reads.keys
                assert redis_client.keys(stream_key("*")) == []
            else:
                assert stream_key(a) in named and stream_key(b) in named
                assert stream_key(c) not in named, reads.keys
        finally:
            await hub.close()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stream_hub, "CHECK_S", 3600.0)  # only the wake entries can bring these
        asyncio.run(run())


def test_inline_entries_written_before_the_follow_wait_for_it(redis_client, redis_server):
    """A job's first entries may be read before its request follows it: they wait in the hub
    (and are dropped after UNCLAIMED_S when no one follows)."""

    async def run() -> None:
        hub = StreamHub(redis_server.url)
        await hub.start()
        try:
            first, early, orphan = _enqueue(redis_client, ["1", "2", "3"], wake=hub.wake_id)
            hub.follow(first)  # the hub reads the wake stream from now on
            adapter, scripts = _worker(redis_client)
            call, started_at = adapter.dequeue_call(3)
            claims = {cl.job_id: cl for cl in adapter.claims(scripts.call(call), started_at)}
            step = [(claims[j], DELTA, True) for j in (early, orphan)]
            assert scripts.call(adapter.stream_call(step)) == []
            await asyncio.sleep(0.4)
            follow = hub.follow(early)
            assert await _next(follow) == DELTA
            await asyncio.sleep(2 * stream_hub.BLOCK_MS / 1000 + 0.5)  # reads after UNCLAIMED_S
            assert orphan not in hub._unclaimed
        finally:
            await hub.close()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stream_hub, "UNCLAIMED_S", 0.5)
        asyncio.run(run())


def test_an_end_the_check_finds_comes_after_the_entries_written_before_it(
    redis_client, redis_server
):
    """The check looks up a quiet job and finds it ended: the inline entries its worker wrote
    with the end (not read yet) reach the follower first, then the real final entry."""

    async def run() -> None:
        hub = StreamHub(redis_server.url)  # not started: the test runs its check by hand
        try:
            [job_id] = _enqueue(redis_client, ["quiet"], wake=hub.wake_id)
            follow = hub.follow(job_id)
            adapter, scripts = _worker(redis_client)
            call, started_at = adapter.dequeue_call(1)
            [claim] = adapter.claims(scripts.call(call), started_at)
            assert scripts.call(adapter.stream_call([(claim, DELTA, True)])) == []
            end = adapter.end_call(claim, "finished", '{"status": "finished"}', (1, 1), DONE)
            assert scripts.call(end) == [1]
            await hub._check_ended()
            assert [follow.entries.get_nowait() for _ in range(2)] == [DELTA, DONE]
            assert follow.entries.empty() and len(hub) == 0
        finally:
            await hub.close()

    asyncio.run(run())


def test_a_stream_whose_worker_tells_no_hub_is_read_by_the_check(redis_client, redis_server):
    async def run() -> None:
        hub = StreamHub(redis_server.url)
        await hub.start()
        try:
            [job_id] = _enqueue(redis_client, ["old"], wake=None)  # as an older release's
            follow = hub.follow(job_id)
            adapter, scripts = _worker(redis_client)
            call, started_at = adapter.dequeue_call(1)
            [claim] = adapter.claims(scripts.call(call), started_at)
            await asyncio.sleep(0.3)
            assert scripts.call(adapter.stream_call([(claim, DELTA, True)])) == []
            assert await _next(follow) == DELTA
        finally:
            await hub.close()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stream_hub, "CHECK_S", 0.5)
        asyncio.run(run())


def test_the_check_looks_up_only_followed_jobs_whose_entries_stopped(redis_client, redis_server):
    """A job whose entries keep coming is not looked up by the periodic check; a quiet one is."""

    async def run() -> None:
        hub = StreamHub(redis_server.url)
        await hub.start()
        try:
            busy, quiet = _enqueue(redis_client, ["busy", "quiet"], wake=hub.wake_id)
            follows = {j: hub.follow(j) for j in (busy, quiet)}
            adapter, scripts = _worker(redis_client)
            call, started_at = adapter.dequeue_call(2)
            claims = {c.job_id: c for c in adapter.claims(scripts.call(call), started_at)}
            assert scripts.call(adapter.stream_call([(claims[busy], DELTA, True)])) == []
            assert await _next(follows[busy]) == DELTA
            reads = XReads(redis_client)
            for _ in range(20):  # 2 s of windows, four checks' worth
                await asyncio.sleep(0.1)
                assert scripts.call(adapter.stream_call([(claims[busy], DELTA, False)])) == []
            await asyncio.sleep(0.2)
            assert reads.exists.count(result_key(quiet)) >= 3, reads.exists
            assert result_key(busy) not in reads.exists, reads.exists
            assert follows[busy].entries.qsize() >= 15 and follows[quiet].entries.empty()
        finally:
            await hub.close()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stream_hub, "CHECK_S", 0.5)
        asyncio.run(run())
