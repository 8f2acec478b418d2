"""Lua scripts with named KEYS and ARGV, and the key prefixes they may use, from the contract.

A script declares the names of its KEYS and ARGV entries; its source opens with a generated
header that binds them (`local k_job = KEYS[1]`, `local a_job_id = ARGV[1]`) and with the
tables `K` (pagedq key prefixes), `RQ` (RQ's) and `F` (pagedq's job-hash fields). Callers
build KEYS and ARGV from the same names (`LuaScript.keys_and_args`), so no one counts
positions, and no script spells a key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from producer.contract.keys import (
    BELL_MAX,
    BELL_TTL_S,
    JOB_FIELDS,
    PAGEDQ,
    RQ,
    RQ_QUEUES,
    RQ_RESULT_FAILED,
    RQ_RESULT_SUCCESSFUL,
    RQ_WORKERS,
)


def _lua_table(name: str, entries: Mapping[str, object]) -> str:
    body = ", ".join(f"{k} = '{v}'" for k, v in entries.items())
    return f"local {name} = {{{body}}}\n"


PRELUDE = (
    _lua_table("K", PAGEDQ)
    + _lua_table("RQ", {**RQ, "queues": RQ_QUEUES, "workers": RQ_WORKERS})
    + _lua_table("F", JOB_FIELDS)
    + _lua_table("RESULT", {"successful": RQ_RESULT_SUCCESSFUL, "failed": RQ_RESULT_FAILED})
)
"""The tables every script sees: `K.result .. job_id` is a job's result key, and so on."""

RING_BELL_LUA = f"""
-- Rings a base queue's doorbell `n` times (worker/doorbell.py): each ring wakes one waiting
-- worker. The bell keeps its last {BELL_MAX} rings, for {BELL_TTL_S} s after the last one.
local function ring_bell(base, n)
    local bell, ring = K.bell .. base, {{}}
    for j = 1, math.min(n, {BELL_MAX}) do ring[j] = '1' end
    redis.call('RPUSH', bell, unpack(ring))
    redis.call('LTRIM', bell, -{BELL_MAX}, -1)
    redis.call('EXPIRE', bell, {BELL_TTL_S})
end
"""
"""The Lua function every script that puts jobs in a queue rings its doorbell with."""


@dataclass(frozen=True, slots=True)
class LuaScript:
    """A Lua script whose KEYS and ARGV are named.

    `keys` and `args` name the fixed entries, bound as `k_<name>` and `a_<name>`; what follows
    them (`ARGV[REST]` on, `KEYS[KEYS_REST]` on) is the script's variable part.
    """

    name: str
    body: str
    keys: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    libraries: tuple[str, ...] = field(default=())  # Lua functions the body calls

    @property
    def source(self) -> str:
        """The full Lua text: prelude, named bindings, libraries, body."""
        bind = [f"local k_{n} = KEYS[{i}]\n" for i, n in enumerate(self.keys, 1)]
        bind += [f"local a_{n} = ARGV[{i}]\n" for i, n in enumerate(self.args, 1)]
        bind.append(f"local KEYS_REST, REST = {len(self.keys) + 1}, {len(self.args) + 1}\n")
        return PRELUDE + "".join(bind) + "".join(self.libraries) + self.body

    def keys_and_args(
        self,
        keys: Mapping[str, str] | None = None,
        args: Mapping[str, Any] | None = None,
        *,
        rest_keys: Sequence[str] = (),
        rest: Sequence[Any] = (),
    ) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of one call; ValueError when a name is missing or unknown."""
        return (
            [*_in_order(self.name, "KEYS", self.keys, keys or {}), *rest_keys],
            [*_in_order(self.name, "ARGV", self.args, args or {}), *rest],
        )


def _in_order(script: str, what: str, names: tuple[str, ...], given: Mapping[str, Any]) -> list:
    if set(given) != set(names):
        missing, unknown = set(names) - set(given), set(given) - set(names)
        raise ValueError(
            f"{script} script {what}: missing {sorted(missing)}, unknown {sorted(unknown)}"
        )
    return [given[n] for n in names]
