"""Script calls and the runner that sends them: EVALSHA, batched in MULTI/EXEC, NOSCRIPT-safe."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import redis

from worker.rq_scripts import SCRIPTS


@dataclass(slots=True)
class ScriptCall:
    """One EVALSHA to run, alone or in a batch; `name` is a key of rq_scripts.SCRIPTS."""

    name: str
    keys: list[str]
    args: list[Any]


@dataclass(slots=True)
class Command:
    """One plain Redis command to run in a batch (e.g. a cancel-key check)."""

    name: str
    args: list[Any]


class ScriptRunner:
    """Runs scripts by EVALSHA; reloads them when Redis answers NOSCRIPT (e.g. after a restart)."""

    def __init__(self, connection: redis.Redis) -> None:
        self.connection = connection
        self.shas = {name: _sha1(source) for name, source in SCRIPTS.items()}

    def load(self) -> None:
        """SCRIPT LOAD every script (idempotent)."""
        for name, source in SCRIPTS.items():
            self.shas[name] = self.connection.script_load(source)

    def call(self, call: ScriptCall) -> Any:
        """Run one script now."""
        return self.run([call])[0]

    def run(self, calls: list[ScriptCall | Command]) -> list[Any]:
        """Run a batch in one MULTI/EXEC (all or nothing on a lost connection); the replies.

        A script refused with NOSCRIPT did not run, so it is reloaded and run again alone.
        Other errors are raised. Connection errors propagate (the caller retries the batch).
        """
        if len(calls) == 1:
            return [self._one(calls[0])]
        with self.connection.pipeline(transaction=True) as pipe:
            for c in calls:
                self._queue(pipe, c)
            replies = pipe.execute(raise_on_error=False)
        for i, reply in enumerate(replies):
            if isinstance(reply, redis.exceptions.NoScriptError):
                replies[i] = self._one(calls[i])
            elif isinstance(reply, Exception):
                raise reply
        return replies

    def _one(self, c: ScriptCall | Command) -> Any:
        if isinstance(c, Command):
            return self.connection.execute_command(c.name, *c.args)
        try:
            return self.connection.evalsha(self.shas[c.name], len(c.keys), *c.keys, *c.args)
        except redis.exceptions.NoScriptError:
            self.load()
            return self.connection.evalsha(self.shas[c.name], len(c.keys), *c.keys, *c.args)

    def _queue(self, pipe: Any, c: ScriptCall | Command) -> None:
        if isinstance(c, Command):
            pipe.execute_command(c.name, *c.args)
        else:
            pipe.evalsha(self.shas[c.name], len(c.keys), *c.keys, *c.args)


def _sha1(source: str) -> str:
    return hashlib.sha1(source.encode()).hexdigest()
