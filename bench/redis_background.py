"""Keep a Redis busy with other work at a set share of one core, for measuring what a fleet's
calls cost a primary that is busy, as a primary holding hundreds of workers is.

A Redis at 2 % load pays a wake-up for nearly every request (epoll returns one ready client,
the server sleeps again); one at 70 % finds most requests waiting when it finishes the previous
one. `bench/redis_capacity.py`'s fleet cannot load Redis that far from one driver core, so a
profile's `/load=U` runs this beside it: `connections` clients each send a Redis Function call
(FCALL, which nothing else sends, so INFO commandstats counts it apart) at a paced rate, every
call writing and reading `KEYS_PER_CALL` keys of a working set of `SPAN` keys (about 20 MB, so
the caches see other data than the fleet's) and spinning the rest of its cost. The time inside
the function is read in the fleet's own window (commandstats), the rest of a call (network,
parsing, the server's cron) at its cost alone, measured before and after the fleet runs; what
the fleet costs is what is left: its marginal cost at that load.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import redis
import redis.asyncio as aioredis

LIBRARY = """#!lua name=pqbench
redis.register_function('pq_background', function(keys, args)
    local first, count, span, spin = tonumber(args[1]), tonumber(args[2]), tonumber(args[3]),
        tonumber(args[4])
    for i = first, first + count - 1 do
        local key = 'pqbg:' .. (i % span)
        redis.call('SET', key, args[5])
        redis.call('GET', 'pqbg:' .. ((i * 7919) % span))
    end
    local x = 0
    for i = 1, spin do x = x + i % 7 end
    return x
end)
"""
FUNCTION = "pq_background"
COMMAND = "fcall"  # its INFO commandstats name
SPAN = 50_000
KEYS_PER_CALL = 100
VALUE = "v" * 400
# The Redis CPU one call aims at: few, long calls, so that little of their cost (the part
# outside the function, taken at its cost alone) is an estimate.
CALL_US = 2000.0


def load_library(conn: redis.Redis) -> None:
    """Load the background's Redis Function."""
    conn.function_load(LIBRARY, replace=True)


def calibrate_spin(conn: redis.Redis, target_us: float = CALL_US) -> int:
    """The spin count that makes one call cost about `target_us` of Redis CPU, serially."""

    def cost(spin: int, calls: int = 200) -> float:
        a = _cpu(conn)
        for i in range(calls):
            conn.fcall(FUNCTION, 0, i * KEYS_PER_CALL, KEYS_PER_CALL, SPAN, spin, VALUE)
        return (_cpu(conn) - a) * 1e6 / calls

    base, with_spin = cost(0), cost(20_000)
    per_spin = max(1e-6, (with_spin - base) / 20_000)
    return max(0, round((target_us - base) / per_spin))


def clear(conn: redis.Redis) -> None:
    """Delete the background's keys (before the memory a fleet left is measured)."""
    batch = []
    for key in conn.scan_iter(match="pqbg:*", count=1000):
        batch.append(key)
        if len(batch) == 1000:
            conn.unlink(*batch)
            batch = []
    if batch:
        conn.unlink(*batch)


def _cpu(conn: redis.Redis) -> float:
    info = conn.info("cpu")
    return info["used_cpu_sys"] + info["used_cpu_user"]


def run_background(url: str, rate: Any, spin: int, connections: int, stop: Any) -> None:
    """A process: `connections` clients together sending `rate.value` calls per second (read
    as it changes) until `stop.value` is set."""
    asyncio.run(_background(url, rate, spin, connections, stop))


async def _background(url: str, rate: Any, spin: int, connections: int, stop: Any) -> None:
    async def client(k: int) -> None:
        conn = aioredis.Redis.from_url(url)
        rng = random.Random(k)
        due = time.monotonic() + rng.random() * connections / rate.value
        try:
            while not stop.value:
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                due = max(due, time.monotonic() - 1.0) + connections / rate.value
                first = rng.randrange(SPAN)
                await conn.fcall(FUNCTION, 0, first, KEYS_PER_CALL, SPAN, spin, VALUE)
        finally:
            await conn.aclose()

    await asyncio.gather(*(client(k) for k in range(connections)))
