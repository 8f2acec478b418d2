"""The gateway's StreamHub against a real redis-server and the worker's own scripts: the
entries of its jobs come inline in its wake stream (or, from workers that write job streams, it
reads only the streams listed there); a stream whose worker tells no hub is still read by its
periodic check."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis_monitor import CommandLog

from gateway import stream_hub
from gateway.stream_hub import StreamHub
from producer.client import Client
from producer.contract.keys import result_key, stream_key
from producer.contract.schema import GenerationRequest
from producer.contract.stream import RESULT_FIELD
from producer.results import is_final
from worker.redis_link import ScriptRunner
from worker.rq_adapter import RQAdapter

QUEUE = "hub-test"
DELTA = {"event": "delta", "delta": "x"}
DONE = {"event": "done", "status": "result"}


class XReads(CommandLog):
    """The stream keys each XREAD names, and the keys of each EXISTS, as Redis runs them."""

    @property
    def keys(self) -> list[list[str]]:
        out = []
        for words in self.words("xread"):
            names = words[[w.lower() for w in words].index("streams") + 1 :]
            out.append(names[: len(names) // 2])
        return out

    @property
    def exists(self) -> list[str]:
        return [key for words in self.words("exists") for key in words[1:]]


def _claimed(redis_client, n: int) -> tuple[RQAdapter, ScriptRunner, dict]:
    """A worker's adapter and script runner, and the `n` jobs it dequeued, by job id."""
    adapter = RQAdapter(redis_client, "w-hub", [QUEUE], lease_ttl=30, result_ttl=600,
                        stream_ttl=600, max_crashes=2)  # fmt: skip
    scripts = ScriptRunner(redis_client)
    call, started_at = adapter.dequeue_call(n)
    claims = {cl.job_id: cl for cl in adapter.claims(scripts.call(call), started_at)}
    return adapter, scripts, claims


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
            adapter, scripts, claims = _claimed(redis_client, 3)
            await asyncio.sleep(0.5)  # the new follows' first reads, and the first check
            reads = XReads(redis_client)
            assert (
                adapter.stream_lost(scripts.call(adapter.stream_call([(claims[a], DELTA, True)])))
                == []
            )
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
            adapter, scripts, claims = _claimed(redis_client, 3)
            step = [(claims[j], DELTA, True) for j in (early, orphan)]
            assert adapter.stream_lost(scripts.call(adapter.stream_call(step))) == []
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


def test_a_read_whose_results_cannot_be_read_still_delivers_its_entries(redis_client, redis_server):
    """The hub reads an ended job's result with one MGET after its wake entries: when that
    fails, the entries it read still reach the follower (without the result, which the
    gateway then GETs), and the next ended job gets its result again."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    async def run() -> None:
        hub = StreamHub(redis_server.url)  # not started: the test reads by hand
        try:
            first, second = _enqueue(redis_client, ["one", "two"], wake=hub.wake_id)
            follows = {j: hub.follow(j) for j in (first, second)}
            adapter, scripts, claims = _claimed(redis_client, 2)
            result = '{"status": "finished"}'

            def end(job_id: str) -> None:
                stage = adapter.stage_result(claims[job_id], result)
                ending = adapter.end_call(claims[job_id], "finished", result, (1, 1), DONE,
                                          entries=[DELTA], staged=True)  # fmt: skip
                assert scripts.run([stage, ending]) == [True, [1]]

            async def failing_mget(*_):
                raise RedisConnectionError("connection lost")

            end(first)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(stream_hub, "mget", failing_mget)
                await hub._read_wakes(None)
            assert [follows[first].entries.get_nowait() for _ in range(2)] == [DELTA, DONE]
            end(second)
            await hub._read_wakes(None)
            ended = {**DONE, RESULT_FIELD: result}
            assert [follows[second].entries.get_nowait() for _ in range(2)] == [DELTA, ended]
        finally:
            await hub.close()

    asyncio.run(run())


def test_an_end_the_check_finds_comes_after_the_entries_written_before_it(
    redis_client, redis_server
):
    """The check looks up a quiet job and finds it ended: the inline entries its worker wrote
    with the end (not read yet) reach the follower first, then the real final entry, with the
    job's result read from its result key."""

    async def run() -> None:
        hub = StreamHub(redis_server.url)  # not started: the test runs its check by hand
        try:
            [job_id] = _enqueue(redis_client, ["quiet"], wake=hub.wake_id)
            follow = hub.follow(job_id)
            adapter, scripts, claims = _claimed(redis_client, 1)
            [claim] = claims.values()
            assert (
                adapter.stream_lost(scripts.call(adapter.stream_call([(claim, DELTA, True)]))) == []
            )
            result = '{"status": "finished"}'
            end = adapter.end_call(claim, "finished", result, (1, 1), DONE)
            assert scripts.call(end) == [1]
            hub._heard[job_id] -= stream_hub.CHECK_S  # quiet for a check interval
            await hub._check_ended()
            ended = {**DONE, RESULT_FIELD: result}
            assert [follow.entries.get_nowait() for _ in range(2)] == [DELTA, ended]
            assert follow.entries.empty() and len(hub) == 0
        finally:
            await hub.close()

    asyncio.run(run())


def test_a_followed_job_is_looked_up_only_once_quiet_for_a_check_interval(
    redis_client, redis_server
):
    """A job followed just now (its request waits for its first tokens) is not looked up by
    the next check: only after CHECK_S without an entry since its follow."""

    async def run() -> None:
        hub = StreamHub(redis_server.url)  # not started: the test runs its check by hand
        try:
            [job_id] = _enqueue(redis_client, ["waiting"], wake=hub.wake_id)
            hub.follow(job_id)
            hub._due.clear()
            reads = XReads(redis_client)
            await hub._check_ended()
            hub._heard[job_id] -= stream_hub.CHECK_S
            await hub._check_ended()
            await asyncio.sleep(0.1)
            assert reads.exists.count(result_key(job_id)) == 1, reads.exists
            assert job_id in hub._due and len(hub) == 1
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
            adapter, scripts, claims = _claimed(redis_client, 1)
            [claim] = claims.values()
            await asyncio.sleep(0.3)
            assert (
                adapter.stream_lost(scripts.call(adapter.stream_call([(claim, DELTA, True)]))) == []
            )
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
            adapter, scripts, claims = _claimed(redis_client, 2)
            assert (
                adapter.stream_lost(
                    scripts.call(adapter.stream_call([(claims[busy], DELTA, True)]))
                )
                == []
            )
            assert await _next(follows[busy]) == DELTA
            reads = XReads(redis_client)
            for _ in range(20):  # 2 s of windows, four checks' worth
                await asyncio.sleep(0.1)
                assert (
                    adapter.stream_lost(
                        scripts.call(adapter.stream_call([(claims[busy], DELTA, False)]))
                    )
                    == []
                )
            await asyncio.sleep(0.2)
            assert reads.exists.count(result_key(quiet)) >= 3, reads.exists
            assert result_key(busy) not in reads.exists, reads.exists
            assert follows[busy].entries.qsize() >= 15 and follows[quiet].entries.empty()
        finally:
            await hub.close()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stream_hub, "CHECK_S", 0.5)
        asyncio.run(run())


def test_a_final_entry_that_carries_its_result_is_answered_without_the_result_key(
    redis_client, redis_server
):
    """An inline hub's final entry carries the job's result: the gateway takes it from there
    (no result key is read), and reads the key only when the entry's result is missing, too
    long or malformed."""
    from types import SimpleNamespace

    from gateway.completions import _result
    from producer.contract.schema import GenerationResult
    from producer.contract.stream import MAX_INLINE_RESULT_CHARS

    inline = GenerationResult(job_id="j1", status="finished", text="from the entry")
    stored = GenerationResult(job_id="j1", status="finished", text="from the key")

    async def run() -> None:
        hub = StreamHub(redis_server.url)
        request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(hub=hub)))
        try:
            entry = {"event": "done", RESULT_FIELD: inline.model_dump_json()}
            assert (await _result(request, "j1", entry)).text == "from the entry"
            redis_client.set(result_key("j1"), stored.model_dump_json())
            too_long = inline.model_dump_json() + " " * MAX_INLINE_RESULT_CHARS
            for value in (too_long, "{not json", None):
                entry = {"event": "done"} | ({RESULT_FIELD: value} if value else {})
                assert (await _result(request, "j1", entry)).text == "from the key"
        finally:
            await hub.close()

    asyncio.run(run())
