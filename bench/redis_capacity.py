"""How many workers one Redis primary holds: Redis's own CPU per job, per token and per worker.

Runs the real Lua scripts, built exactly as a worker and a producer build them (`RQAdapter`,
`RedisLink`, `JobEnder`, `StreamState`, `Leases`, `StatusPublisher` on the worker side;
`Client.enqueue` -> `enqueue_jobs`, `EventFollower`, `final_result`, and the gateway's
`Enqueuer` and `StreamHub` on the producer side), against one private redis-server, with N
simulated workers and no model: the engine is a clock that gives every running job one token
per step. What is measured is Redis's own CPU (INFO cpu: used_cpu_sys + used_cpu_user of the
server process), so the speed of the Python drivers is not the figure; they only have to keep
Redis busy enough to read.

    .venv/bin/python bench/redis_capacity.py        # the defaults below, about 100 s on 2 cores
    .venv/bin/python bench/redis_capacity.py --workers 16 --slots 48 --steps-per-s 40 \\
        --tokens 200 --jobs 6000 --target-jobs-per-s 10 --target-tokens 200

Each simulated worker (worker/control_loop.py's loop with the engine replaced by a clock):
registers (REGISTER); while it has room takes up to 8 jobs per DEQUEUE call (MAX_PENDING_ADDS),
up to `--slots` in flight, and claims bulk jobs ahead to wait for a slot (`--prefetch`, as
EngineLoop.admission and ControlLoop._admit do); steps `--steps-per-s` times a second while it
holds jobs; writes the token entries of the jobs that stream in one STREAM call per
`--stream-interval` window (one entry per job, its first token at once: the worker's own
StreamWindow) and ends every job that reached its tokens in one merged END call (a gateway
job's last tokens inside it; STREAM and END as one STEP call when there are both, as the
worker's `step_write` does); checks the cancel keys of its jobs every 5 s
(MGET, the fallback for lost cancel messages); heartbeats every
lease_ttl/3 and reaps every lease_ttl/2 (Leases); publishes its status key at most every 2 s
(StatusPublisher); with room and its queue found empty, waits for its doorbell (BLPOP of the
bells producers ring as they enqueue, worker/doorbell.py; a ring is seen at its next turn, at
most 0.1 s later) and asks the queue again every 2 s anyway.
Jobs have between tokens/2 and 3*tokens/2 tokens (mean `--tokens`), so endings are spread.

Producers: bulk jobs are enqueued and read as `pagedq submit` does (BulkRun: chunks of 256
through `Client.enqueue` with a notify id, an EXISTS per job it did not create, ends read from
one events stream with EventFollower, each result read with one GET); streaming jobs as the
gateway serves streaming requests (`--window` clients each sending one request after the
other; the gateway's Enqueuer coalesces requests that arrive together into one
`Client.enqueue`; its StreamHub follows every stream with one XREAD and checks the followed
jobs every 2 s; the result comes in the job's final entry). The producers keep `--window`
jobs outstanding (default 1.25 x workers x slots, plus 2.5 x workers x prefetch of bulk jobs),
so the queue never runs dry inside the measured window.

Runs, each on a fresh redis-server:

1. fixed costs: the server alone; `--workers` idle workers; the same workers busy, each
   holding `--slots` jobs that do not end within the window (bulk); one heartbeat and one reap
   forced on every worker (they come every 20 s and 30 s with the default 60 s lease, rarer
   than the window); the same busy workers with every job streaming (per stream entry).
2. one steady run per profile (`--profiles`, default bulk = no job streams, interactive = every
   job streams; `mix:F` = a fraction F of jobs streams): `--jobs` jobs, measured between the
   first 2 x slots x workers ended jobs and the point where the producers stop refilling.

3. with `/load=U` on a profile, the same run while other work (bench/redis_background.py)
   keeps Redis busy at U of a core, its cost taken out: what the fleet costs a busy primary,
   whose requests share the event loop's wake-ups. The same profile at several loads gives
   the workers per core when each added worker costs what the load before it makes a job cost.

From these it prints Redis CPU per finished job and per generated token, commands per job
(INFO commandstats: everything Redis executed, script internals included; and the commands
the clients sent), the memory left per job, and how many busy workers of a given speed
(`--target-jobs-per-s`, `--target-tokens`, `--target-steps-per-s`) one Redis core holds at
`--cpu-budget` of that core.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import heapq
import multiprocessing as mp
import os
import queue as queue_mod
import random
import shutil
import string
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import redis

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import redis_background  # noqa: E402  (bench/, beside this script)
from redis_ops import memory_by_kind  # noqa: E402

from gateway.enqueuer import Enqueuer  # noqa: E402
from gateway.stream_hub import StreamHub  # noqa: E402
from producer.client import COUNT_CANCELED, Client  # noqa: E402
from producer.contract.codec import load_job_data  # noqa: E402
from producer.contract.keys import (  # noqa: E402
    DEFAULT_RESULT_TTL,
    DEFAULT_STREAM_TTL,
    result_key,
    rq_registry_key,
)
from producer.contract.schema import GenerationRequest  # noqa: E402
from producer.contract.stream import RESULT_FIELD, entry_delta  # noqa: E402
from producer.enqueue import ENQUEUE_IF_ABSENT  # noqa: E402
from producer.events import EventFollower  # noqa: E402
from producer.results import final_results, is_final  # noqa: E402
from worker.coalesce import AdmissionGate, EndCoalescer, StreamWindow  # noqa: E402
from worker.doorbell import SAFETY_POLL_S, Doorbell  # noqa: E402
from worker.endings import JobEnder, StepWrite, step_write  # noqa: E402
from worker.engine_loop import MAX_PENDING_ADDS  # noqa: E402
from worker.inflight import InFlight, StreamState, stream_entries, window_entries  # noqa: E402
from worker.leases import Leases  # noqa: E402
from worker.redis_link import RedisLink, connect  # noqa: E402
from worker.redis_server import PrivateRedis  # noqa: E402
from worker.rq_adapter import RQAdapter  # noqa: E402
from worker.rq_scripts import SCRIPTS  # noqa: E402
from worker.status import StatusPublisher  # noqa: E402

QUEUE = "cap"
MODEL = "sim"
# The worker's defaults (worker/config.py: WorkerConfig, worker/limits.py: JobLimits), and its
# control loop's timings (worker/control_loop.py); importing those modules would load torch.
LEASE_TTL = 60
STREAM_INTERVAL_S = 0.1
MAX_CRASHES = 2
JOB_TIMEOUT_S = 3600.0
MAX_PAYLOAD_BYTES = 1 << 20
CANCEL_POLL_S = 5.0
EMPTY_QUEUE_BACKOFF_S = 0.1
IDLE_POLL_S = (0.01, 0.25)
ADMISSION_BURST_S = 0.05
AHEAD_BACKOFF_S = 0.5
BELL_CHECK_S = 0.1
PREFETCH = -1  # WorkerConfig.prefetch: a quarter of the requests running
COALESCE_WINDOW_S = 0.1  # WorkerConfig.coalesce_window
BULK_COALESCE_WINDOW_S = 1.0  # WorkerConfig.bulk_coalesce_window
BACKGROUND_CONNECTIONS = 16  # clients of a /load=U background (bench/redis_background.py)
# Bulk producers enqueue in BulkRun's chunks (producer/bulk.py).
BULK_CHUNK = 256
# The gateway waits this long for a result key after a done entry (gateway/completions.py).
RESULT_GRACE_S = 2.0
# A held job's max_tokens: it does not end within a fixed-cost window.
HOLD_TOKENS = 1_000_000
VOCAB = 49_152
# Latencies an online producer reports at most (a random sample of what it read).
LATENCY_SAMPLES = 100_000
WORDS = [
    " " + "".join(random.Random(i).choices(string.ascii_lowercase, k=2 + i % 6))
    for i in range(2000)
]

SCRIPT_NAMES = {
    hashlib.sha1(s.source.encode()).hexdigest(): s.name
    for s in (*SCRIPTS, ENQUEUE_IF_ABSENT, COUNT_CANCELED)
}
ADMIN_COMMANDS = {"info", "config|resetstat", "memory|usage", "scan", "ping", "client|setinfo"}


# --- counting what clients send ----------------------------------------------------------------


def _name(args: tuple) -> str:
    name = args[0].decode() if isinstance(args[0], bytes) else str(args[0])
    name = name.upper()
    if name == "EVALSHA" and len(args) > 1:
        sha = args[1].decode() if isinstance(args[1], bytes) else str(args[1])
        return f"EVALSHA({SCRIPT_NAMES.get(sha, '?')})"
    return name


class CountingConnection(redis.Connection):
    """redis-py's connection, counting every command it sends (pipelines and MULTI/EXEC too)."""

    counts: Counter = Counter()

    def send_command(self, *args: Any, **kwargs: Any) -> None:
        CountingConnection.counts[_name(args)] += 1
        super().send_command(*args, **kwargs)

    def pack_commands(self, commands: Any) -> Any:
        commands = list(commands)
        for args in commands:
            CountingConnection.counts[_name(args)] += 1
        return super().pack_commands(commands)


def count_async_commands() -> None:
    """Count what redis-py's asyncio connections send too (the gateway's StreamHub and its
    pool): patched in a driver process only."""
    from redis.asyncio.connection import AbstractConnection

    send, pack = AbstractConnection.send_command, AbstractConnection.pack_commands

    async def send_command(self: Any, *args: Any, **kwargs: Any) -> None:
        CountingConnection.counts[_name(args)] += 1
        await send(self, *args, **kwargs)

    def pack_commands(self: Any, commands: Any) -> Any:
        commands = list(commands)
        for args in commands:
            CountingConnection.counts[_name(args)] += 1
        return pack(self, commands)

    AbstractConnection.send_command = send_command
    AbstractConnection.pack_commands = pack_commands


def worker_connection(url: str) -> redis.Redis:
    """worker.redis_link.connect(url), counting the commands it sends."""
    return connect(url, connection_class=CountingConnection)


# --- state shared by the coordinator and its driver processes -----------------------------------


class Shared:
    """Flags and counters the coordinator and the driver processes share."""

    def __init__(self, ctx: Any) -> None:
        self.stop = ctx.Value("i", 0, lock=False)
        # 1 inside the measured window, 2 after it: each process snapshots its sent commands.
        self.mark = ctx.Value("i", 0, lock=False)
        # Bumped by the coordinator: 1 = every worker heartbeats now, 2 = every worker reaps now.
        self.poke = ctx.Value("i", 0, lock=False)
        self.poke_seq = ctx.Value("i", 0, lock=False)
        # Set by the coordinator: online producers stop reading (their jobs keep streaming).
        self.readers_off = ctx.Value("i", 0, lock=False)
        self.ended = ctx.Value("q", 0)
        self.tokens = ctx.Value("q", 0)
        self.entries = ctx.Value("q", 0)
        self.steps = ctx.Value("q", 0)
        self.held = ctx.Value("q", 0)
        self.lost = ctx.Value("q", 0)
        self.read = ctx.Value("q", 0)
        self.sent = ctx.Queue()
        # Each online producer's delays from a token's sampling to its reading, ms (sampled).
        self.latency = ctx.Queue()


def _add(value: Any, n: int) -> None:
    if n:
        with value.get_lock():
            value.value += n


class MarkWatcher:
    """Snapshots this process's sent-command counts when the coordinator moves the mark."""

    def __init__(self, shared: Shared, role: str) -> None:
        self.shared, self.role = shared, role
        self.snaps: dict[int, Counter] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = 0
        while not self._done.wait(0.005):
            mark = self.shared.mark.value
            if mark != last:
                self.snaps[mark] = Counter(CountingConnection.counts)
                last = mark

    def finish(self) -> None:
        self._done.set()
        self._thread.join()
        self.shared.sent.put((self.role, self.snaps.get(1), self.snaps.get(2)))


# --- a simulated worker -------------------------------------------------------------------------


@dataclass
class Sim:
    """What the simulated fleet looks like."""

    workers: int
    slots: int
    steps_per_s: float
    tokens: int
    prompt_chars: int
    drivers: int
    lease_ttl: int
    window: int
    coalesce_window: float = COALESCE_WINDOW_S
    bulk_coalesce_window: float = BULK_COALESCE_WINDOW_S
    stream_interval: float = STREAM_INTERVAL_S
    prefetch: int = PREFETCH
    redis_cpu: int | None = None  # the core redis-server has to itself (None: shared)
    load: float = 0.0  # share of a core other work keeps Redis busy with (redis_background.py)

    @property
    def prefetch_jobs(self) -> int:
        """The workers' --prefetch, -1 resolved as EngineLoop.admission does (a quarter of the
        requests running: of the slots, for a busy worker)."""
        return self.slots // 4 if self.prefetch < 0 else self.prefetch


class SimWorker:
    """One worker's Redis traffic, built by the worker's own classes; the engine is a clock."""

    def __init__(self, url: str, name: str, sim: Sim, shared: Shared, rng: random.Random) -> None:
        self.sim, self.shared, self.rng = sim, shared, rng
        self.conn = worker_connection(url)
        self.adapter = RQAdapter(
            self.conn,
            name,
            [QUEUE],
            lease_ttl=sim.lease_ttl,
            result_ttl=DEFAULT_RESULT_TTL,
            stream_ttl=DEFAULT_STREAM_TTL,
            max_crashes=MAX_CRASHES,
        )
        self.link = RedisLink(self.conn)
        self.ender = JobEnder(self.adapter, self.link, MODEL, metrics=None)
        self.leases = Leases(sim.lease_ttl)
        config = {"model": MODEL, "queue": QUEUE, "queues": [QUEUE], "max_num_seqs": sim.slots}
        self.status = StatusPublisher(self.conn, name, config, self._stats, lambda: self.in_flight)
        self.in_flight: dict[str, InFlight] = {}
        self.gen: dict[str, tuple[SimpleNamespace, int, list[int]]] = {}
        self.step_s = 1.0 / sim.steps_per_s
        self.next_step_at = 0.0
        self.num_steps = self.num_tokens = self.num_started = 0
        self._queue_empty = False
        self._next_dequeue_at = 0.0
        self._next_ahead_at = 0.0
        # Jobs claimed ahead (--prefetch), waiting for a slot as they wait in the engine.
        self.waiting: list[Any] = []
        self._idle_poll_s = IDLE_POLL_S[0]
        self._next_cancel_poll_at = 0.0
        self.endings: EndCoalescer = EndCoalescer(sim.coalesce_window)
        self.gate = AdmissionGate(sim.coalesce_window)
        self.window = StreamWindow(sim.stream_interval)
        self.bell = Doorbell(self.conn, self.adapter.bell_keys())

    def _stats(self) -> SimpleNamespace:
        n = len(self.in_flight)
        blocks = self.sim.slots * 16
        return SimpleNamespace(
            num_running=n,
            num_waiting=0,
            kv_cache_usage=n / self.sim.slots,
            num_blocks=blocks,
            num_free_blocks=blocks - n * 16,
            num_preemptions=0,
            prefix_cache_hit_rate=0.0,
            num_steps=self.num_steps,
            num_generated_tokens=self.num_tokens,
            num_scheduled_requests=self.num_started,
        )

    def register(self) -> None:
        if not self.link.scripts.call(self.adapter.register_call()):
            raise RuntimeError(f"worker name {self.adapter.name} taken")
        self.bell.start()

    def stop(self) -> None:
        """As a worker that stops cleanly: status key and RQ registration removed."""
        self.bell.stop()
        self.status.clear()
        self.adapter.unregister()

    def turn(self) -> float:
        """One turn of the control loop; returns the monotonic time of the next one."""
        t = time.monotonic()
        busy_before = bool(self.in_flight)
        self._promote()
        if self.in_flight and not busy_before:
            self.next_step_at = t
        if self.in_flight and t >= self.next_step_at:
            self._step()
            self.next_step_at = max(self.next_step_at + self.step_s, t)
        if self.window.due(t):
            self._write(window_entries(self.window.take(), self.in_flight), [])
        if self.endings.due(t):
            self._write([], [])
        busy_before = bool(self.in_flight)
        self._admit()
        if self.in_flight and not busy_before:
            self.next_step_at = time.monotonic()
        self._handle_cancels()
        self._maintain()
        self.status.maybe_publish()
        ends_in = _earliest(self.endings.wait_s(t), self.window.wait_s(t))
        if self.in_flight:
            return self.next_step_at if ends_in is None else min(self.next_step_at, t + ends_in)
        if ends_in is not None:
            return t + ends_in
        if self._queue_empty:  # a ring is seen at the next turn, as the worker's event wait
            return min(self._next_dequeue_at, t + BELL_CHECK_S)
        return time.monotonic()

    def _promote(self) -> None:
        """Jobs claimed ahead run as slots free up (the engine's scheduler)."""
        while self.waiting and len(self.in_flight) < self.sim.slots:
            self._start(self.waiting.pop(0))

    def _room(self) -> tuple[int, int]:
        """EngineLoop.admission: free slots (at most MAX_PENDING_ADDS, none while jobs wait),
        and how many more may wait (--prefetch)."""
        self._promote()
        room = 0 if self.waiting else self.sim.slots - len(self.in_flight)
        return min(MAX_PENDING_ADDS, room), max(0, self.sim.prefetch_jobs - len(self.waiting))

    # admission: worker/control_loop.py ControlLoop._admit, with room = free slots, at most
    # MAX_PENDING_ADDS (8) a call, as EngineLoop.admission gives, and bulk jobs claimed ahead.
    def _admit(self) -> None:
        now = time.monotonic()
        if now < self._next_dequeue_at and not self.bell.rang.is_set():
            return
        prefetch = self.sim.prefetch_jobs
        room, ahead = self._room()
        if not self.gate.ready(room, len(self.in_flight), now):
            if not (ahead and ahead >= (prefetch + 1) // 2 and now >= self._next_ahead_at):
                return
            room = 0
        self.gate.dequeued()
        self.bell.rang.clear()
        deadline = time.monotonic() + ADMISSION_BURST_S
        while True:
            call, started_at = self.adapter.dequeue_call(room, ahead)
            ok, reply = self.link.attempt(lambda c=call: self.link.scripts.call(c))
            claims = self.adapter.claims(reply, started_at) if ok else []
            if len(claims) <= room and ahead:
                self._next_ahead_at = time.monotonic() + AHEAD_BACKOFF_S
            if not claims and not room:
                return
            if not claims:
                self._queue_empty = True
                if ok:  # ControlLoop._on_empty_queue: wait for a ring (worker/doorbell.py)
                    self.bell.want(True)
                    self._next_dequeue_at = time.monotonic() + SAFETY_POLL_S
                    return
                if self.in_flight:
                    backoff = EMPTY_QUEUE_BACKOFF_S
                else:
                    backoff = self._idle_poll_s
                    self._idle_poll_s = min(IDLE_POLL_S[1], self._idle_poll_s * 2)
                self._next_dequeue_at = time.monotonic() + backoff
                return
            self._queue_empty = False
            self._idle_poll_s = IDLE_POLL_S[0]
            self._next_dequeue_at = 0.0
            self.bell.want(False)
            for claim in claims[:room]:
                self._start(claim)
            self.waiting += claims[room:]
            _add(self.shared.held, len(claims))
            if time.monotonic() >= deadline or not room:
                break
            room, ahead = self._room()
            if not room:
                break

    def _start(self, claim: Any) -> None:
        _, _, args, _ = load_job_data(claim.data, MAX_PAYLOAD_BYTES)
        payload = args[0]
        stream = bool(payload.get("stream"))
        self.in_flight[claim.job_id] = InFlight(
            claim=claim,
            request=None,
            stream=StreamState.for_attempt(claim.attempt, stream),
            enqueued_at=claim.enqueued_time(),
            started_at=claim.started_at,
            deadline=time.monotonic() + claim.timeout_s(JOB_TIMEOUT_S),
        )
        completion = SimpleNamespace(
            index=0, text="", token_ids=[], finish_reason=None, logprobs=None
        )
        prompt_ids = [0] * max(1, len(payload.get("prompt", "")) // 4)
        self.gen[claim.job_id] = (completion, int(payload["max_tokens"]), prompt_ids)
        self.num_started += 1

    # one engine step: worker/control_loop.py ControlLoop._on_step
    def _step(self) -> None:
        now = time.time()
        t = time.monotonic()
        entries: list = []
        ends = []
        rng = self.rng
        for job_id, item in list(self.in_flight.items()):
            completion, target, prompt_ids = self.gen[job_id]
            completion.token_ids.append(rng.randrange(VOCAB))
            completion.text += _stamp(now)
            finished = len(completion.token_ids) >= target
            if finished:
                completion.finish_reason = "length"
            item.last_output = SimpleNamespace(outputs=[completion])
            if item.first_token_at is None:
                item.first_token_at = now
            item.last_token_at = now
            if finished:
                del self.in_flight[job_id]
                del self.gen[job_id]
                self.window.discard(job_id)
                output = SimpleNamespace(
                    outputs=[completion], prompt_token_ids=prompt_ids, finished=True
                )
                ending = self.ender.finish(item, output, stream_entries(item))
                entries += ending.entries
                self.num_tokens += 1
                window = self.sim.bulk_coalesce_window if item.claim.bulk else None
                if item.stream.enabled or not self.endings.hold(ending, t, window):
                    ends.append(ending)
            elif item.stream.enabled:
                if self.window.add(job_id, t, item.stream.num_tokens == 0):
                    entries += stream_entries(item)
        if self.window.due(t):
            entries += window_entries(self.window.take(), self.in_flight)
        self.num_steps += 1
        self.num_tokens += len(self.in_flight)
        if entries or ends or self.endings.due(time.monotonic()):
            self._write(entries, ends)
        _add(self.shared.steps, 1)

    # ControlLoop._write_ends
    def _write(self, entries: list, ends: list) -> None:
        ends = self.endings.take() + ends
        if not entries and not ends:
            return
        write = step_write(self.adapter, entries, ends)
        self.link.run(write.calls, lambda replies: self._written(write, replies, entries, ends))

    def _written(self, write: StepWrite, replies: list, entries: list, ends: list) -> None:
        lost = 0
        streamed, end_replies = write.read(replies)
        if streamed is not None:
            lost += len(self.adapter.stream_lost(streamed))
            _add(self.shared.entries, len(entries))
        ended = tokens = 0
        for ending, reply in zip(ends, end_replies, strict=True):
            if reply:
                ended += 1
                tokens += ending.result.usage.completion_tokens
            else:
                lost += 1
        _add(self.shared.ended, ended)
        _add(self.shared.tokens, tokens)
        _add(self.shared.held, -len(ends))
        _add(self.shared.lost, lost)

    def _handle_cancels(self) -> None:
        t = time.monotonic()
        if self.in_flight and t >= self._next_cancel_poll_at:
            self._next_cancel_poll_at = t + CANCEL_POLL_S
            call = self.adapter.cancel_check([*self.in_flight, *(c.job_id for c in self.waiting)])
            self.link.attempt(lambda: self.link.scripts.call(call))

    def _maintain(self) -> None:
        if self.leases.heartbeat_due():
            claims = [i.claim for i in self.in_flight.values()] + self.waiting
            claims += [e.claim for e in self.endings.pending]
            call = self.adapter.heartbeat_call(claims, "busy" if claims else "idle")
            ok, lost = self.link.attempt(lambda: self.link.scripts.call(call))
            _add(self.shared.lost, len(lost or []))
        if self.leases.reap_due():
            self.link.attempt(lambda: self.link.scripts.call(self.adapter.reap_call()))


def _earliest(*waits: float | None) -> float | None:
    known = [w for w in waits if w is not None]
    return min(known) if known else None


# A simulated token's text is the time it was sampled (ms, 7 digits: about as long as a real
# token's text), so a reader measures the latency from sampling to itself exactly.
STAMP_MOD = 10**7


def _stamp(now: float) -> str:
    return f" {int(now * 1000) % STAMP_MOD:07d}"


def _stamp_delays_ms(delta: str, now: float) -> list[float]:
    now_ms = now * 1000
    return [(now_ms - int(w)) % STAMP_MOD for w in delta.split()]


def drive_workers(url: str, names: list[str], sim: Sim, shared: Shared, seed: int) -> None:
    """A driver process: its simulated workers' turns, in time order, on one thread."""
    watcher = MarkWatcher(shared, "worker")
    rng = random.Random(seed)
    workers = [SimWorker(url, n, sim, shared, random.Random(rng.random())) for n in names]
    for w in workers:
        w.register()
    heap = [(time.monotonic() + rng.random() * 0.02, i) for i in range(len(workers))]
    heapq.heapify(heap)
    poke_seq = 0
    while not shared.stop.value:
        if shared.poke_seq.value != poke_seq:
            poke_seq = shared.poke_seq.value
            for w in workers:
                if shared.poke.value == 1:
                    w.leases.next_heartbeat_at = 0.0
                else:
                    w.leases.next_reap_at = 0.0
            heap = [(0.0, i) for i in range(len(workers))]
        t, i = heap[0]
        delay = t - time.monotonic()
        if delay > 0:
            time.sleep(min(delay, 0.02))
            continue
        heapq.heapreplace(heap, (workers[i].turn(), i))
    watcher.finish()
    for w in workers:
        w.stop()


# --- producers ----------------------------------------------------------------------------------


def _prompt(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(WORDS)
        words.append(w)
        n += len(w)
    return "".join(words).strip()


def _payload(rng: random.Random, sim: Sim, max_tokens: int | None, stream: bool) -> dict:
    lo, hi = max(1, sim.tokens // 2), sim.tokens + sim.tokens // 2
    return {
        "prompt": _prompt(rng, sim.prompt_chars),
        "max_tokens": max_tokens or rng.randint(lo, max(lo, hi)),
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }


def produce_bulk(
    url: str, n_jobs: int, window: int, sim: Sim, shared: Shared, seed: int, max_tokens: Any
) -> None:
    """A bulk producer process, as `pagedq submit` (producer/bulk.py BulkRun): chunks of 256
    through `Client.enqueue` with its notify id, refilled a quarter chunk at a time, an
    EXISTS per job it did not create, ends from the events stream (EventFollower), then the
    results of each read in one MGET (`final_results`)."""
    watcher = MarkWatcher(shared, "producer")
    rng = random.Random(seed)
    writer = redis.Redis.from_url(url, connection_class=CountingConnection)
    reader = redis.Redis.from_url(url, connection_class=CountingConnection)
    client = Client(connection=writer, queue=QUEUE, outage_timeout=60)
    batch_id = f"capacity-{seed}"
    follower = EventFollower(reader, notify=batch_id)
    follower.open()
    new_ids: queue_mod.SimpleQueue[str] = queue_mod.SimpleQueue()
    done = [0]

    def enqueue_loop() -> None:
        submitted = 0
        while submitted < n_jobs and not shared.stop.value:
            room = min(window - (submitted - done[0]), BULK_CHUNK, n_jobs - submitted)
            if room < min(BULK_CHUNK, window) // 4 and room < n_jobs - submitted:
                time.sleep(0.002)
                continue
            requests = []
            for i in range(submitted, submitted + room):
                payload = _payload(rng, sim, max_tokens, False) | {"custom_id": f"line-{i}"}
                requests.append(GenerationRequest.parse(payload))
            enqueued = client.enqueue_created(
                requests, id_namespace=batch_id, notify=follower.notify
            )
            pipe = writer.pipeline(transaction=False)
            for job_id, created in enqueued:
                if not created:
                    pipe.exists(result_key(job_id))
            if len(pipe):
                pipe.execute()
            for job_id, _ in enqueued:
                new_ids.put(job_id)
            submitted += room

    thread = threading.Thread(target=enqueue_loop, daemon=True)
    thread.start()
    while done[0] < n_jobs and not shared.stop.value:
        while True:
            try:
                follower.add(new_ids.get_nowait())
            except queue_mod.Empty:
                break
        if not len(follower):
            time.sleep(0.005)
            continue
        ended = [(j, e) for j, e in follower.read(0.1) if is_final(e)]
        final_results(reader, ended)
        done[0] += len(ended)
        _add(shared.read, len(ended))
    thread.join()
    watcher.finish()


def produce_online(
    url: str, n_jobs: int, window: int, sim: Sim, shared: Shared, seed: int, max_tokens: Any
) -> None:
    """An online producer process, as the gateway serves streaming requests
    (gateway/completions.py): `window` clients, each sending one request after the other;
    each request enqueued through the gateway's Enqueuer (requests arriving together share
    one `Client.enqueue`), its stream followed through the gateway's StreamHub (one XREAD
    over every followed stream, the followed jobs checked every 2 s), its result read from its
    final entry (a GET only when the entry has none)."""
    count_async_commands()
    watcher = MarkWatcher(shared, "producer")
    asyncio.run(_online(url, n_jobs, window, sim, shared, seed, max_tokens, watcher))


async def _online(
    url: str,
    n_jobs: int,
    window: int,
    sim: Sim,
    shared: Shared,
    seed: int,
    max_tokens: Any,
    watcher: MarkWatcher,
) -> None:
    rng = random.Random(seed)
    conn = redis.Redis.from_url(url, connection_class=CountingConnection)
    hub = StreamHub(url)
    enqueuer = Enqueuer(Client(connection=conn, queue=QUEUE, outage_timeout=60), wake=hub.wake_id)
    await hub.start()
    left = [n_jobs]
    delays: list[float] = []

    async def request() -> None:
        job_id = await enqueuer.submit(
            GenerationRequest.parse(_payload(rng, sim, max_tokens, True))
        )
        follow = hub.follow(job_id)
        try:
            while not is_final(entry := await follow.entries.get()):
                if shared.mark.value == 1 and (delta := entry_delta(entry)):
                    delays.extend(_stamp_delays_ms(delta, time.time()))
            # The gateway's _result: the result the final entry carries, else its key.
            deadline = time.monotonic() + RESULT_GRACE_S
            while RESULT_FIELD not in entry and await hub.redis.get(result_key(job_id)) is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no result for {job_id}")
                await asyncio.sleep(0.05)
        finally:
            hub.unfollow(follow)
        _add(shared.read, 1)

    async def client() -> None:
        while left[0] > 0:
            left[0] -= 1
            await request()

    clients = [asyncio.create_task(client()) for _ in range(min(window, n_jobs))]
    while not all(c.done() for c in clients) and not shared.stop.value:
        if shared.readers_off.value:
            break
        await asyncio.sleep(0.05)
    for c in clients:
        c.cancel()
    try:
        await asyncio.wait_for(asyncio.gather(*clients, return_exceptions=True), 10)
        await asyncio.wait_for(hub.close(), 10)
    except TimeoutError:
        _log("online producer: the stream hub did not close within 10 s")
    while not shared.stop.value:
        await asyncio.sleep(0.05)
    shared.latency.put(rng.sample(delays, min(len(delays), LATENCY_SAMPLES)))
    watcher.finish()


# --- the coordinator ----------------------------------------------------------------------------


@dataclass
class Snap:
    """Redis's CPU and command counts, and the drivers' counters, at one moment."""

    t: float
    cpu: float
    sys: float
    used_memory: int
    cmds: dict[str, tuple[int, int]]
    ended: int
    tokens: int
    entries: int
    steps: int

    def __sub__(self, other: Snap) -> Delta:
        cmds = {
            k: (c - other.cmds.get(k, (0, 0))[0], u - other.cmds.get(k, (0, 0))[1])
            for k, (c, u) in self.cmds.items()
            if k not in ADMIN_COMMANDS
        }
        return Delta(
            self.t - other.t,
            (self.cpu - other.cpu) * 1e6,
            (self.sys - other.sys) * 1e6,
            self.used_memory - other.used_memory,
            {k: v for k, v in cmds.items() if v[0]},
            self.ended - other.ended,
            self.tokens - other.tokens,
            self.entries - other.entries,
            self.steps - other.steps,
        )


@dataclass
class Delta:
    """What happened between two snaps; cpu_us is Redis's CPU in microseconds."""

    dt: float
    cpu_us: float
    sys_us: float
    used_memory: int
    cmds: dict[str, tuple[int, int]]
    ended: int
    tokens: int
    entries: int
    steps: int

    @property
    def rate(self) -> float:
        """Redis CPU, microseconds per second."""
        return self.cpu_us / self.dt


@dataclass
class Run:
    """One private redis-server with its driver processes."""

    sim: Sim
    ctx: Any
    server: PrivateRedis = field(init=False)
    admin: redis.Redis = field(init=False)
    shared: Shared = field(init=False)
    procs: list = field(default_factory=list)
    sent: dict[str, Counter] = field(default_factory=dict)
    latency_ms: list[float] = field(default_factory=list)
    online: int = 0

    def __post_init__(self) -> None:
        self.server = PrivateRedis()
        self.admin = self.server.client()
        if self.sim.redis_cpu is not None:
            pid = int(self.admin.info("server")["process_id"])
            os.sched_setaffinity(pid, {self.sim.redis_cpu})
        self.shared = Shared(self.ctx)

    def _spawn(self, target: Any, *args: Any) -> None:
        p = self.ctx.Process(target=target, args=args, daemon=True)
        p.start()
        self.procs.append(p)

    def start_workers(self, prefix: str = "cap-w") -> None:
        names = [f"{prefix}{i}" for i in range(self.sim.workers)]
        n = max(1, min(self.sim.drivers, len(names)))
        for d in range(n):
            self._spawn(drive_workers, self.server.url, names[d::n], self.sim, self.shared, d)

    def start_producer(
        self, kind: str, n_jobs: int, window: int, seed: int, max_tokens: int | None = None
    ) -> None:
        target = produce_bulk if kind == "bulk" else produce_online
        self.online += target is produce_online
        self._spawn(
            target, self.server.url, n_jobs, window, self.sim, self.shared, seed, max_tokens
        )

    def snap(self) -> Snap:
        cpu = self.admin.info("cpu")
        used_memory = self.admin.info("memory")["used_memory"]
        stats = self.admin.info("commandstats")
        s = self.shared
        return Snap(
            time.monotonic(),
            cpu["used_cpu_sys"] + cpu["used_cpu_user"],
            cpu["used_cpu_sys"],
            used_memory,
            {k.removeprefix("cmdstat_"): (v["calls"], v["usec"]) for k, v in stats.items()},
            s.ended.value,
            s.tokens.value,
            s.entries.value,
            s.steps.value,
        )

    def wait(self, cond: Any, what: str, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not reached within {timeout} s")
            for p in self.procs:
                if p.exitcode not in (None, 0):
                    raise RuntimeError(f"a driver process exited with {p.exitcode} ({what})")
            time.sleep(0.01)

    def poke(self, what: int) -> None:
        self.shared.poke.value = what
        self.shared.poke_seq.value += 1

    def stop(self) -> None:
        self.shared.stop.value = 1
        for _ in self.procs:
            try:
                role, before, after = self.shared.sent.get(timeout=30)
            except queue_mod.Empty:
                alive = [p.pid for p in self.procs if p.is_alive()]
                _log(f"a driver process did not report its commands (alive: {alive})")
                break
            if before is not None and after is not None:
                self.sent[role] = self.sent.get(role, Counter()) + (after - before)
        for _ in range(self.online):
            try:
                self.latency_ms += self.shared.latency.get(timeout=30)
            except queue_mod.Empty:
                _log("an online producer did not report its latencies")
        for p in self.procs:
            p.join(30)

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():  # a run that failed half-way
                p.terminate()
                p.join(5)
        self.server.close()


def _log(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)


@dataclass
class Fixed:
    """Redis CPU, microseconds per second, of what does not grow with jobs."""

    baseline: float
    idle_worker: float
    busy_worker: float
    heartbeat: float  # one heartbeat of a busy worker, microseconds
    reap: float  # one reap call, microseconds
    entry: float  # writing one stream entry, microseconds
    entries_per_s: float
    # Reading the streams, as the gateway's StreamHub does (woken by the workers, then reading
    # the streams that got entries; its 2 s check of the followed jobs included): per entry
    # written, microseconds; and what was measured.
    read_entry: float
    xread_calls_per_s: float
    followed: int


def measure_fixed(sim: Sim, ctx: Any, hold_s: float) -> Fixed:
    n = sim.workers
    held = n * sim.slots
    run = Run(sim, ctx)
    try:
        a = run.snap()
        time.sleep(2.0)
        baseline = (run.snap() - a).rate
        _log(f"fixed: baseline {baseline:.0f} us/s")
        run.start_workers()
        time.sleep(2.5)
        a = run.snap()
        time.sleep(4.0)
        idle = ((run.snap() - a).rate - baseline) / n
        _log(f"fixed: idle worker {idle:.0f} us/s")
        run.start_producer("bulk", held, held, seed=1, max_tokens=HOLD_TOKENS)
        run.wait(lambda: run.shared.held.value >= held, "bulk jobs held")
        time.sleep(1.5)
        a = run.snap()
        time.sleep(hold_s)
        hold = run.snap() - a
        busy = (hold.rate - baseline) / n
        _log(f"fixed: busy worker {busy:.0f} us/s")
        costs = []
        for what in (1, 2):  # one heartbeat, then one reap, on every worker
            a = run.snap()
            run.poke(what)
            time.sleep(1.0)
            d = run.snap() - a
            costs.append(max(0.0, d.cpu_us - hold.rate * d.dt) / n)
        _log(f"fixed: heartbeat {costs[0]:.0f} us, reap {costs[1]:.0f} us per worker")
        run.stop()
    finally:
        run.close()
    run = Run(sim, ctx)
    try:
        run.start_workers()
        run.start_producer("interactive", held, held, seed=2, max_tokens=HOLD_TOKENS)
        run.wait(lambda: run.shared.held.value >= held, "streaming jobs held")
        time.sleep(1.5)
        a = run.snap()
        time.sleep(hold_s)
        read = run.snap() - a
        run.shared.readers_off.value = 1  # the same jobs go on streaming, unread
        time.sleep(1.5)
        a = run.snap()
        time.sleep(hold_s)
        write = run.snap() - a
        entries_per_s = write.entries / write.dt
        entry = (write.rate - baseline - n * busy) / entries_per_s
        xreads = read.cmds.get("xread", (0, 0))[0]
        # The hub's cost two ways: Redis's CPU beyond the writers' (all of it, but a difference
        # of two noisy runs), and the time inside its own commands (steady, without the
        # network's share); the model takes the larger.
        hub = read.cpu_us - read.dt * (baseline + n * busy) - read.entries * entry
        inside = sum(read.cmds.get(c, (0, 0))[1] for c in ("xread", "exists", "xrange"))
        read_entry = max(hub, inside) / read.entries if read.entries else 0.0
        _log(
            f"fixed: {entries_per_s:.0f} entries/s, {entry:.1f} us per entry written; "
            f"{xreads / read.dt:.0f} XREAD/s following {held} streams; per entry read "
            f"{hub / max(read.entries, 1):.2f} us of CPU beyond the writers', "
            f"{inside / max(read.entries, 1):.2f} us inside its commands"
        )
        run.stop()
    finally:
        run.close()
    return Fixed(
        baseline, idle, busy, costs[0], costs[1], entry, entries_per_s, read_entry,
        xreads / read.dt, held,
    )  # fmt: skip


@dataclass
class Profile:
    """One steady run's figures."""

    name: str
    stream_fraction: float
    window: Delta
    sent: dict[str, Counter]
    memory_per_job: float
    memory_kinds: Counter
    used_memory_per_job: float
    jobs: int
    finished: int
    lost: int
    followed: int  # streams the online producer follows (its clients)
    stream_interval: float  # the workers' --stream-interval
    prefetch: int  # the workers' --prefetch, resolved
    latency_ms: list[float]  # sorted: a token's sampling to its reading, ms (a sample)
    load: float = 0.0  # the background's share of a core, alone (0: none)
    background_call_us: float = 0.0  # Redis CPU per background call, alone

    def latency(self, q: float) -> str:
        """The q-quantile of `latency_ms`, or "-"."""
        if not self.latency_ms:
            return "-"
        return (
            f"{self.latency_ms[min(len(self.latency_ms) - 1, int(q * len(self.latency_ms)))]:.0f}"
        )


def parse_profile(spec: str, sim: Sim) -> tuple[str, float, Sim]:
    """(name, fraction of jobs streaming, the fleet) of a profile: NAME[@S][/prefetch=N]
    [/load=U], @S the workers' --stream-interval, /prefetch=N their --prefetch, /load=U other
    work keeping Redis busy at U of a core (the fleet's cost is then its marginal cost)."""
    base, *options = spec.split("/")
    name, _, interval = base.partition("@")
    sim = dataclasses.replace(
        sim, stream_interval=float(interval) if interval else sim.stream_interval
    )
    for option in options:
        key, _, value = option.partition("=")
        try:
            if key == "prefetch":
                sim = dataclasses.replace(sim, prefetch=int(value))
            elif key == "load" and 0 < float(value) < 1:
                sim = dataclasses.replace(sim, load=float(value))
            else:
                raise ValueError(option)
        except ValueError:
            raise ValueError(
                f"profile {spec!r}: options are /prefetch=N (an integer) and /load=U (0 < U < 1)"
            ) from None
    if name == "bulk":
        return spec, 0.0, sim
    if name in ("stream", "interactive"):
        return spec, 1.0, sim
    if name.startswith("mix:"):
        return spec, float(name[4:]), sim
    raise ValueError(
        f"profile {spec!r}: bulk, stream (alias interactive) or mix:FRACTION, each with an "
        "optional @SECONDS (the workers' --stream-interval) and /prefetch=N (their --prefetch)"
    )


def measure_profile(sim: Sim, ctx: Any, spec: str, jobs: int) -> Profile:
    name, fraction, sim = parse_profile(spec, sim)
    interval = sim.stream_interval
    run = Run(sim, ctx)
    empty = run.admin.info("memory")["used_memory"]
    background = Background(run, ctx, sim.load) if sim.load else None
    try:
        if background:
            background.measure_alone()
        n_stream = round(jobs * fraction)
        kinds = [(k, n) for k, n in (("bulk", jobs - n_stream), ("interactive", n_stream)) if n]
        windows = {kind: max(1, round(sim.window * n / jobs)) for kind, n in kinds}
        if "bulk" in windows:  # a queue deep enough that busy workers claim ahead (--prefetch)
            windows["bulk"] += round(2.5 * sim.workers * sim.prefetch_jobs * kinds[0][1] / jobs)
        for seed, (kind, n) in enumerate(kinds, 10):
            run.start_producer(kind, n, windows[kind], seed=seed)
        run.start_workers()
        slots = sim.workers * sim.slots
        # From one turnover of every slot to where the producers stop refilling.
        start_at = slots
        end_at = jobs - sim.window
        if end_at < start_at + jobs // 5:
            end_at = start_at + jobs // 5
            _log(f"{name}: --jobs is small for the window: the measure may include the tail")
        run.wait(lambda: run.shared.ended.value >= start_at, f"{start_at} jobs ended")
        run.shared.mark.value = 1
        a = run.snap()
        _log(f"{name}: measuring from {a.ended} ended jobs")
        run.wait(lambda: run.shared.ended.value >= end_at, f"{end_at} jobs ended")
        b = run.snap()
        run.shared.mark.value = 2
        _log(f"{name}: measured until {b.ended} ended jobs, {b.t - a.t:.1f} s")
        run.wait(lambda: run.shared.read.value >= jobs, "every result read")
        time.sleep(0.3)
        run.stop()
        window = b - a
        if background:
            background.measure_alone()
            window = background.remove(window)
            background.stop()
            redis_background.clear(run.admin)
        finished = run.admin.zcard(rq_registry_key("finished", QUEUE))
        memory = memory_by_kind(run.admin)
        used = run.admin.info("memory")["used_memory"]
        return Profile(
            name, fraction, window, run.sent, sum(memory.values()) / jobs, memory,
            (used - empty) / jobs, jobs, finished, run.shared.lost.value,
            windows.get("interactive", 0), interval, sim.prefetch_jobs, sorted(run.latency_ms),
            background.load if background else 0.0, background.call_us if background else 0.0,
        )  # fmt: skip
    finally:
        if background:
            background.stop()
        run.close()


class Background:
    """Other work keeping a Run's Redis busy (bench/redis_background.py), its own cost measured
    alone (`measure_alone`, before and after the fleet) and taken out of a window (`remove`)."""

    ALONE_S = 4.0

    def __init__(self, run: Run, ctx: Any, load: float) -> None:
        self.run = run
        redis_background.load_library(run.admin)
        spin = redis_background.calibrate_spin(run.admin)
        self._rate = ctx.Value("d", load * 1e6 / redis_background.CALL_US)
        self._stop = ctx.Value("b", 0)
        self.proc = ctx.Process(
            target=redis_background.run_background,
            args=(run.server.url, self._rate, spin, BACKGROUND_CONNECTIONS, self._stop),
            daemon=True,
        )
        self.proc.start()
        self.alone: list[Delta] = []
        for _ in range(3):  # the calibration was serial: set the rate by the load it makes
            time.sleep(1.0)
            a = run.snap()
            time.sleep(2.0)
            d = run.snap() - a
            self._rate.value *= load / max(0.01, d.rate / 1e6)

    def measure_alone(self) -> None:
        """A window of the background alone (the fleet not started, or stopped)."""
        a = self.run.snap()
        time.sleep(self.ALONE_S)
        self.alone.append(self.run.snap() - a)

    def _calls(self, d: Delta) -> int:
        return d.cmds.get(redis_background.COMMAND, (0, 0))[0]

    @property
    def call_us(self) -> float:
        """Redis CPU per background call, alone (the server's cron included)."""
        return sum(d.cpu_us for d in self.alone) / max(1, sum(self._calls(d) for d in self.alone))

    @property
    def load(self) -> float:
        """The share of a core the background kept Redis busy with, alone."""
        return sum(d.cpu_us for d in self.alone) / sum(d.dt for d in self.alone) / 1e6

    def remove(self, w: Delta) -> Delta:
        """`w` less the background's calls: their time inside the function as measured in `w`
        itself (INFO commandstats; the machine's speed of that moment), and the rest of each
        call (network, parsing, the server's cron) at its cost alone: what the fleet cost."""
        calls = self._calls(w)
        alone_calls = max(1, sum(self._calls(d) for d in self.alone))
        inside_alone = sum(d.cmds.get(redis_background.COMMAND, (0, 0))[1] for d in self.alone)
        outside = (sum(d.cpu_us for d in self.alone) - inside_alone) / alone_calls
        inside = w.cmds.get(redis_background.COMMAND, (0, 0))[1]
        sys_per_call = sum(d.sys_us for d in self.alone) / alone_calls
        cmds = dict(w.cmds)
        cmds.pop(redis_background.COMMAND, None)
        for name in ("set", "get"):  # what each background call ran inside
            if name in cmds:
                n, usec = cmds[name]
                left = max(0, n - calls * redis_background.KEYS_PER_CALL)
                cmds[name] = (left, round(usec * left / n) if n else 0)
        return dataclasses.replace(
            w,
            cpu_us=w.cpu_us - inside - calls * outside,
            sys_us=w.sys_us - calls * sys_per_call,
            cmds={k: v for k, v in cmds.items() if v[0]},
        )

    def stop(self) -> None:
        self._stop.value = 1
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()


# --- arithmetic and tables ----------------------------------------------------------------------


def entries_per_job(tokens: int, steps_per_s: float, interval: float) -> int:
    """Token entries a job of `tokens` tokens writes at `steps_per_s` with the worker's own
    StreamWindow over a clock (its first token at once, then one entry per `interval`, its
    last with its end; the final done entry, written by END, is part of the job's own cost)."""
    window = StreamWindow(interval)
    n = 0
    for k in range(tokens):
        t = k / steps_per_s
        if window.due(t):
            n += len(window.take())
        if k == tokens - 1:
            window.discard("job")
            n += 1
        elif window.add("job", t, first=k == 0):
            n += 1
    return n


@dataclass
class PerJob:
    """A profile's Redis CPU per job, split into what scales with workers, entries and jobs."""

    all_in: float
    fixed: float
    entries: float
    reading: float
    job: float
    per_token: float


def split_costs(p: Profile, f: Fixed, sim: Sim) -> PerJob:
    w = p.window
    # With a background, the server's own cron is part of the background's cost, removed.
    fixed = w.dt * ((0.0 if p.load else f.baseline) + sim.workers * f.busy_worker)
    fixed += w.dt * sim.workers * (f.heartbeat / (sim.lease_ttl / 3) + f.reap / (sim.lease_ttl / 2))
    entries = w.entries * f.entry
    reading = w.entries * f.read_entry if p.followed else 0.0
    return PerJob(
        all_in=w.cpu_us / w.ended,
        fixed=fixed / w.ended,
        entries=entries / w.ended,
        reading=reading / w.ended,
        job=(w.cpu_us - fixed - entries - reading) / w.ended,
        per_token=w.cpu_us / w.tokens,
    )


def print_tables(
    sim: Sim,
    f: Fixed,
    profiles: list[Profile],
    args: argparse.Namespace,
    cal: tuple[float, float] | None,
) -> None:
    print(
        f"\nsimulated fleet: {sim.workers} workers x {sim.slots} slots, {sim.steps_per_s:g} "
        f"steps/s, jobs of {sim.tokens} tokens on average (uniform {max(1, sim.tokens // 2)}.."
        f"{sim.tokens + sim.tokens // 2}), prompts of {sim.prompt_chars} chars, lease "
        f"{sim.lease_ttl} s; {sim.drivers} worker driver processes; Redis CPU = INFO cpu "
        "used_cpu_sys + used_cpu_user of the server"
    )
    print("\nFixed costs (Redis CPU)")
    print("| what | Redis CPU |")
    print("|---|---:|")
    print(f"| the server alone (cron) | {f.baseline:.0f} us/s |")
    print(f"| per idle worker (polling an empty queue) | {f.idle_worker:.0f} us/s |")
    print(
        f"| per busy worker holding {sim.slots} jobs (status key, cancel check; no ends) | "
        f"{f.busy_worker:.0f} us/s |"
    )
    hb, rp = sim.lease_ttl / 3, sim.lease_ttl / 2
    print(f"| one heartbeat of {sim.slots} leases (every {hb:g} s) | {f.heartbeat:.0f} us |")
    print(f"| one reap call (every {rp:g} s) | {f.reap:.0f} us |")
    print(f"| one stream entry written ({f.entries_per_s:.0f} entries/s) | {f.entry:.1f} us |")
    print(
        f"| the gateway's StreamHub: reading, per stream entry (measured: "
        f"{f.xread_calls_per_s:.0f} XREAD/s following {f.followed} streams) | "
        f"{f.read_entry:.2f} us |"
    )

    print("\nSteady profiles (measured window; per finished job)")
    cols = [p.name for p in profiles]
    print("| | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    splits = [split_costs(p, f, sim) for p in profiles]

    def row(label: str, values: list[str]) -> None:
        print(f"| {label} | " + " | ".join(values) + " |")

    row("jobs streaming", [f"{p.stream_fraction:.0%}" for p in profiles])
    row("window: jobs ended", [f"{p.window.ended}" for p in profiles])
    row("window: seconds", [f"{p.window.dt:.1f}" for p in profiles])
    row(
        "jobs/s per worker (achieved)",
        [f"{p.window.ended / p.window.dt / sim.workers:.1f}" for p in profiles],
    )
    row(
        "steps/s per worker (achieved)",
        [f"{p.window.steps / p.window.dt / sim.workers:.1f}" for p in profiles],
    )
    row("workers' --stream-interval (s)", [f"{p.stream_interval:g}" for p in profiles])
    row("workers' --prefetch (jobs)", [f"{p.prefetch}" for p in profiles])
    if any(p.load for p in profiles):
        row(
            "other work keeping Redis busy (share of a core; its CPU per call, taken out)",
            [f"{p.load:.0%} ({p.background_call_us:.0f} us)" if p.load else "-" for p in profiles],
        )
    row(
        "jobs per DEQUEUE call",
        [
            f"{p.window.ended / d:.1f}"
            if (d := p.sent.get("worker", {}).get("EVALSHA(dequeue)"))
            else "-"
            for p in profiles
        ],
    )
    row("tokens per job", [f"{p.window.tokens / p.window.ended:.1f}" for p in profiles])
    row("stream entries per job", [f"{p.window.entries / p.window.ended:.1f}" for p in profiles])
    row("Redis CPU, share of one core", [f"{p.window.rate / 1e6:.1%}" for p in profiles])
    row("**Redis CPU per job, all in (us)**", [f"**{s.all_in:.0f}**" for s in splits])
    row("... of which per-worker fixed costs (us)", [f"{s.fixed:.0f}" for s in splits])
    row("... of which writing stream entries (us)", [f"{s.entries:.0f}" for s in splits])
    row(
        "... of which the stream hub's XREADs (us)",
        [
            f"{s.reading:.0f} ({p.window.cmds.get('xread', (0, 0))[0] / p.window.dt:.0f}/s, "
            f"following {p.followed} streams)"
            if p.followed
            else "-"
            for p, s in zip(profiles, splits)
        ],
    )
    row("... of which the job itself (us)", [f"{s.job:.0f}" for s in splits])
    row(
        "... in system calls (used_cpu_sys; the rest is user)",
        [f"{p.window.sys_us / p.window.ended:.0f}" for p in profiles],
    )
    row("Redis CPU per generated token, all in (us)", [f"{s.per_token:.2f}" for s in splits])
    row(
        "**Redis CPU per streamed token, writers and readers (us)**",
        [
            f"**{s.per_token:.2f}**" if p.stream_fraction == 1 else "-"
            for p, s in zip(profiles, splits)
        ],
    )
    row(
        "streamed tokens per stream entry",
        [
            f"{p.window.tokens / p.window.entries:.1f}" if p.window.entries else "-"
            for p in profiles
        ],
    )
    row(
        "latency from sampling to a reader, p50 / p99 (ms)",
        [f"{p.latency(0.5)} / {p.latency(0.99)}" for p in profiles],
    )
    row(
        "commands executed per job (commandstats)",
        [f"{sum(c for c, _ in p.window.cmds.values()) / p.window.ended:.1f}" for p in profiles],
    )
    for role in ("worker", "producer"):
        row(
            f"commands sent per job by the {role}s",
            [f"{sum(p.sent.get(role, Counter()).values()) / p.window.ended:.2f}" for p in profiles],
        )
    row(
        "memory left per job (MEMORY USAGE of all keys)",
        [f"{p.memory_per_job:.0f} B" for p in profiles],
    )
    row(
        "used_memory growth per job (whole run)",
        [f"{p.used_memory_per_job:.0f} B" for p in profiles],
    )
    row(
        "used_memory growth per job (measured window)",
        [f"{p.window.used_memory / p.window.ended:.0f} B" for p in profiles],
    )
    row("jobs finished / lost leases", [f"{p.finished}/{p.jobs} / {p.lost}" for p in profiles])

    for p in profiles:
        n = p.window.ended
        print(f"\n{p.name}: commands per job, by name (commandstats: calls, usec = wall time)")
        for name, (calls, usec) in sorted(p.window.cmds.items(), key=lambda kv: -kv[1][0])[:14]:
            print(f"  {name:<22}{calls / n:8.2f} {usec / n:9.1f} us")
        print(f"{p.name}: commands sent per job, by client")
        for role, counter in sorted(p.sent.items()):
            for name, calls in counter.most_common(10):
                print(f"  {role:<9}{name:<26}{calls / n:8.2f}")
        print(f"{p.name}: memory left per job, by key kind")
        for kind, size in p.memory_kinds.most_common(8):
            print(f"  {kind:<28}{size / p.jobs:8.0f} B")

    budget = args.cpu_budget * 1e6
    print(
        f"\nCapacity of one Redis core at {args.cpu_budget:.0%}, measured: busy workers of the "
        "simulated speed (Redis CPU of the steady window less the server's own, per worker)"
    )
    print(
        "| profile | jobs/s per worker | Redis CPU per worker | workers per core | jobs/s "
        "| tokens/s |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for p in profiles:
        w = p.window
        jps = w.ended / w.dt / sim.workers
        us = (w.rate - (0.0 if p.load else f.baseline)) / sim.workers
        n = budget / us
        tps = w.tokens / w.ended
        print(
            f"| {p.name} | {jps:.1f} | {us:,.0f} us/s | {n:,.0f} | {n * jps:,.0f} | "
            f"{n * jps * tps:,.0f} |"
        )

    print_load_curve(sim, f, profiles, args.cpu_budget)

    t, s = args.target_tokens, args.target_token_rate
    j = args.target_seqs * s / t
    interval = args.stream_interval
    e = entries_per_job(t, s, interval)
    per_worker_fixed = (
        f.busy_worker + f.heartbeat / (sim.lease_ttl / 3) + f.reap / (sim.lease_ttl / 2)
    )
    # The last profile of each kind (after a /prefetch=0 baseline, the default).
    bulk = next(
        (sp for p, sp in reversed([*zip(profiles, splits)]) if p.stream_fraction == 0), None
    )
    inter = next(
        (sp for p, sp in reversed([*zip(profiles, splits)]) if p.stream_fraction == 1), None
    )
    read_entry = f.read_entry  # the hub's reads, per entry written (the fixed run's)
    print(
        f"\nCapacity of one Redis core at {args.cpu_budget:.0%}, modeled: busy workers each "
        f"running {args.target_seqs} sequences at {s:g} tokens/s ({j:.1f} jobs/s of {t} tokens, "
        f"{j * t:g} tokens/s), --stream-interval {interval:g} ({e} token entries per streaming "
        f"job), from the fixed costs, the job's own cost and the entries' (each written at "
        f"{f.entry:.1f} us and read at {read_entry:.1f} us, as the streaming profile measured)"
    )
    print("| profile | Redis CPU per worker | workers per core | jobs/s | tokens/s |")
    print("|---|---:|---:|---:|---:|")
    rows = []
    if bulk:
        rows.append(("bulk", per_worker_fixed + j * bulk.job))
    if inter:
        rows.append(("stream", per_worker_fixed + j * (inter.job + e * (f.entry + read_entry))))
    if bulk and inter:
        for share in (0.1, 0.3):
            mixed = (1 - share) * bulk.job + share * (inter.job + e * (f.entry + read_entry))
            rows.append((f"{share:.0%} of jobs stream", per_worker_fixed + j * mixed))
    for label, us in rows:
        n = budget / us
        print(f"| {label} | {us:,.0f} us/s | {n:,.0f} | {n * j:,.0f} | {n * j * t:,.0f} |")
    if rows:
        print(
            f"(per worker: {per_worker_fixed:.0f} us/s fixed + jobs/s x the job's own cost; "
            f"the stream entries at {f.entry:.1f} us each; idle workers cost "
            f"{f.idle_worker:.0f} us/s each; a gateway's StreamHub reads an entry at "
            f"{read_entry:.2f} us, whatever the number of streams it follows.)"
        )
    if cal is not None:
        us_set, ops = cal
        print(
            f"\nCalibration: this redis-server spends {us_set:.1f} us of CPU per SET round trip "
            f"at saturation ({ops:,.0f} SET/s on one core; redis-benchmark -t set -c 50 -P 1); "
            "Redis CPU per job in SET round trips: "
            + ", ".join(f"{p.name} {sp.all_in / us_set:.0f}" for p, sp in zip(profiles, splits))
        )


def workers_at_budget(points: list[tuple[float, float]], jobs_per_s: float, budget: float) -> float:
    """Busy workers whose Redis CPU fills `budget` of a core, each one added costing the
    marginal cost per job of the load the workers before it made: `points` are (load, Redis
    CPU per job in us) measured at background loads, linear between them and flat past the
    last. N = integral of dL / (jobs_per_s x cost(L)) from 0 to `budget`."""
    points = sorted(points)
    steps, n = 700, 0.0
    for i in range(steps):
        load = (i + 0.5) * budget / steps
        if load <= points[0][0]:
            cost = points[0][1]
        elif load >= points[-1][0]:
            cost = points[-1][1]
        else:
            (l0, c0), (l1, c1) = next(
                (a, b) for a, b in zip(points, points[1:]) if a[0] <= load <= b[0]
            )
            cost = c0 + (c1 - c0) * (load - l0) / (l1 - l0)
        n += (budget / steps) * 1e6 / (jobs_per_s * cost)
    return n


def print_load_curve(sim: Sim, f: Fixed, profiles: list[Profile], budget: float) -> None:
    """For each profile measured at several background loads (NAME, NAME/load=U, ...): its
    Redis CPU per job at each load, and the busy workers one core holds at `budget` when each
    added worker costs what the load so far makes a job cost (`workers_at_budget`)."""
    groups: dict[str, list[Profile]] = {}
    for p in profiles:
        base = "/".join(o for o in p.name.split("/") if not o.startswith("load="))
        groups.setdefault(base, []).append(p)
    for base, group in groups.items():
        if len(group) < 2 or not any(p.load for p in group):
            continue
        points, rates = [], []
        for p in group:
            w = p.window
            own = w.cpu_us - (0.0 if p.load else f.baseline * w.dt)  # the fleet's alone
            points.append((p.load, own / w.ended))
            rates.append(w.ended / w.dt / sim.workers)
        jobs_per_s = sum(rates) / len(rates)
        print(
            f"\n{base}: Redis CPU per job (all in, the fleet's own) by how busy other work kept "
            "Redis; busy workers per core when each added worker costs what the load before it "
            "makes a job cost"
        )
        print(
            "| other work (share of a core) | " + " | ".join(f"{ld:.0%}" for ld, _ in points) + " |"
        )
        print("|---|" + "---:|" * len(points))
        print("| Redis CPU per job | " + " | ".join(f"{c:.0f} us" for _, c in points) + " |")
        n = workers_at_budget(points, jobs_per_s, budget)
        print(
            f"busy workers per core at {budget:.0%}, integrated over load: {n:,.0f} "
            f"({jobs_per_s:.1f} jobs/s each)"
        )


def calibrate() -> tuple[float, float] | None:
    """Redis CPU per SET round trip at saturation (redis-benchmark, 50 clients), and SET/s:
    this machine's yardstick, to carry the figures to another one."""
    tool = shutil.which("redis-benchmark") or shutil.which("valkey-benchmark")
    if tool is None:
        return None
    server = PrivateRedis()
    try:
        admin = server.client()

        def cpu() -> float:
            info = admin.info("cpu")
            return info["used_cpu_sys"] + info["used_cpu_user"]

        def calls() -> int:
            return admin.info("commandstats").get("cmdstat_set", {}).get("calls", 0)

        c0, n0 = cpu(), calls()
        subprocess.run(
            [tool, "-p", str(server.port), "-t", "set", "-n", "200000", "-c", "50", "-r",
             "100000", "-q"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        c1, n1 = cpu(), calls()
        return (c1 - c0) * 1e6 / (n1 - n0), (n1 - n0) / (c1 - c0)
    finally:
        server.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=12, help="simulated workers")
    p.add_argument("--slots", type=int, default=50, help="jobs in flight per worker at most")
    p.add_argument("--steps-per-s", type=float, default=40.0, help="engine steps/s per worker")
    p.add_argument("--tokens", type=int, default=200, help="mean tokens per job")
    p.add_argument("--jobs", type=int, default=3000, help="jobs per steady profile")
    p.add_argument(
        "--profiles",
        default="stream,bulk",
        help="stream (every job streams, read live; alias interactive), bulk, mix:F (a "
        "fraction F streams); each with an optional @S, the workers' --stream-interval, "
        "/prefetch=N, their --prefetch (bulk/prefetch=0,bulk: without and with claiming ahead), "
        "and /load=U, other work keeping Redis busy at U of a core (bulk,bulk/load=0.3,"
        "bulk/load=0.6: the cost per job by load, and the workers per core it gives)",
    )
    p.add_argument(
        "--stream-interval",
        type=float,
        default=STREAM_INTERVAL_S,
        help="the workers' --stream-interval (0: every step writes its tokens)",
    )
    p.add_argument("--prompt-chars", type=int, default=200)
    p.add_argument("--drivers", type=int, default=2, help="processes simulating the workers")
    p.add_argument("--lease-ttl", type=int, default=LEASE_TTL)
    p.add_argument(
        "--prefetch",
        type=int,
        default=PREFETCH,
        help="the workers' --prefetch (-1: a quarter of --slots; 0: claim only free slots)",
    )
    p.add_argument(
        "--shared-core",
        dest="redis_core",
        action="store_false",
        help="let redis-server share the cores with the simulated fleet (by default it has the "
        "first core to itself and the fleet the others)",
    )
    p.add_argument(
        "--coalesce-window",
        type=float,
        default=COALESCE_WINDOW_S,
        help="the workers' --coalesce-window (0: every step writes its own endings)",
    )
    p.add_argument(
        "--bulk-coalesce-window",
        type=float,
        default=BULK_COALESCE_WINDOW_S,
        help="the workers' --bulk-coalesce-window",
    )
    p.add_argument(
        "--window",
        type=int,
        default=0,
        help="jobs outstanding (0: 1.25 x workers x slots, and for bulk jobs 2.5 x workers x "
        "prefetch more)",
    )
    p.add_argument("--hold-s", type=float, default=6.0, help="fixed-cost windows, seconds")
    p.add_argument("--cpu-budget", type=float, default=0.7, help="share of one Redis core")
    p.add_argument("--target-seqs", type=int, default=64, help="modeled: sequences per worker")
    p.add_argument(
        "--target-token-rate", type=float, default=30.0, help="modeled: tokens/s per sequence"
    )
    p.add_argument("--target-tokens", type=int, default=200, help="modeled: tokens per job")
    p.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="skip the redis-benchmark yardstick (SET round trips at saturation)",
    )
    args = p.parse_args()
    sim = Sim(
        workers=args.workers,
        slots=args.slots,
        steps_per_s=args.steps_per_s,
        tokens=args.tokens,
        prompt_chars=args.prompt_chars,
        drivers=args.drivers,
        lease_ttl=args.lease_ttl,
        window=args.window,
        coalesce_window=args.coalesce_window,
        bulk_coalesce_window=args.bulk_coalesce_window,
        stream_interval=args.stream_interval,
        prefetch=args.prefetch,
    )
    if not sim.window:
        sim.window = round(1.25 * sim.workers * sim.slots)
    cpus = sorted(os.sched_getaffinity(0))
    if args.redis_core and len(cpus) >= 2:
        # As in production, Redis gets a core of its own: the simulated fleet (these processes
        # and their children) runs on the others, so their load does not inflate Redis's CPU.
        sim.redis_cpu = cpus[0]
        os.sched_setaffinity(0, set(cpus[1:]))
    ctx = mp.get_context("fork")
    t0 = time.monotonic()
    fixed = measure_fixed(sim, ctx, args.hold_s)
    profiles = [
        measure_profile(sim, ctx, spec.strip(), args.jobs) for spec in args.profiles.split(",")
    ]
    cal = calibrate() if args.calibrate else None
    print_tables(sim, fixed, profiles, args, cal)
    print(f"\n(run took {time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
