"""Lua scripts with named KEYS and ARGV, and the key prefixes they may use, from the contract.

A script declares the names of its KEYS and ARGV entries; its source opens with a generated
header that binds them (`local k_job = KEYS[1]`, `local a_job_id = ARGV[1]`) and with the
tables `K` (pagedq key prefixes), `RQ` (RQ's) and `F` (pagedq's job-hash fields), whose
entries the source gets as literals (constants of the compiled script). Callers
build KEYS and ARGV from the same names (`LuaScript.keys_and_args`), so no one counts
positions, and no script spells a key.
"""

from __future__ import annotations

import functools
import re
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

# The tables a script names its keys' prefixes and fields by: `K.result .. job_id` is a job's
# result key, and so on.
TABLES: dict[str, Mapping[str, object]] = {
    "K": PAGEDQ,
    "RQ": {**RQ, "queues": RQ_QUEUES, "workers": RQ_WORKERS},
    "F": JOB_FIELDS,
    "RESULT": {"successful": RQ_RESULT_SUCCESSFUL, "failed": RQ_RESULT_FAILED},
}
_FIELD = re.compile(r"(?<![\w.])(" + "|".join(TABLES) + r")\.([A-Za-z_]\w*)")
_INDEXED = re.compile(r"(?<![\w.])(" + "|".join(TABLES) + r")\[")


def _lua_table(name: str, entries: Mapping[str, object]) -> str:
    body = ", ".join(f"{k} = '{v}'" for k, v in entries.items())
    return f"local {name} = {{{body}}}\n"


_DEFINES = re.compile(r"local (?:function (\w+)|([\w, ]+?) =)")
_NAME = re.compile(r"[A-Za-z_]\w*")
_COMMENT = re.compile(r"--[^\n]*")


def _names(lua: str) -> set[str]:
    """The names `lua` uses outside its comments (a comment naming a function needs none)."""
    return set(_NAME.findall(_COMMENT.sub("", lua)))


def _needed(libraries: str, body: str) -> str:
    """The top-level definitions of `libraries` (each a `local function` or `local` line at
    column 0, with the comments above it) that `body` uses, directly or through another, in
    their order: Lua builds a closure or table for each definition at every call, used or not.
    """
    chunks: list[list[str]] = []
    lines: list[str] = []
    pending: list[str] = []
    for line in libraries.splitlines(keepends=True):
        if line.startswith("local "):
            if lines:
                chunks.append(lines)
            lines, pending = [*pending, line], []
        elif line.startswith("--") or not line.strip():
            pending.append(line)
        else:
            lines += [*pending, line]
            pending = []
    if lines:
        chunks.append(lines)
    defined: dict[str, int] = {}
    for i, chunk in enumerate(chunks):
        head = next(line for line in chunk if line.startswith("local "))
        m = _DEFINES.match(head)
        assert m, f"not a definition: {head!r}"
        for name in (m.group(1) or m.group(2)).split(","):
            defined[name.strip()] = i
    keep: set[int] = set()
    todo = _names(body)
    while todo:
        i = defined.get(todo.pop())
        if i is not None and i not in keep:
            keep.add(i)
            todo |= _names("".join(chunks[i]))
    return "".join("".join(chunks[i]) for i in sorted(keep))


def _with_literals(text: str) -> str:
    """`text` with each `K.name` (and RQ., F., RESULT.) replaced by its quoted value, and the
    tables it still indexes by a variable (`RQ[status]`) defined before it: a literal is a
    constant of the compiled script, where a table would be built again at every call (some
    20,000 instructions of every EVALSHA). A name the table lacks is an error here, not a nil
    key at run time."""

    def literal(m: re.Match) -> str:
        table, name = TABLES[m.group(1)], m.group(2)
        if name not in table:
            raise ValueError(f"Lua script names {m.group(0)}; {m.group(1)} has {sorted(table)}")
        return f"'{table[name]}'"

    text = _FIELD.sub(literal, text)
    used = dict.fromkeys(m.group(1) for m in _INDEXED.finditer(text))
    return "".join(_lua_table(name, TABLES[name]) for name in used) + text


@functools.cache
def _source(script: LuaScript) -> str:
    return _with_literals(script.written)


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
        """The full Lua text: named bindings, libraries, body, the contract's prefixes and
        fields written in as literals (`_with_literals`); built once per script."""
        return _source(self)

    @property
    def written(self) -> str:
        """The Lua text as written: named bindings, libraries, body (prefixes by table)."""
        bind = [f"local k_{n} = KEYS[{i}]\n" for i, n in enumerate(self.keys, 1)]
        bind += [f"local a_{n} = ARGV[{i}]\n" for i, n in enumerate(self.args, 1)]
        bind.append(f"local KEYS_REST, REST = {len(self.keys) + 1}, {len(self.args) + 1}\n")
        return "".join(bind) + _needed("".join(self.libraries), self.body) + self.body

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
