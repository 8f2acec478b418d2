"""The dequeue script's fair pick and end-of-job charge, run alone (test helper)."""

from __future__ import annotations

from typing import Any

from producer.contract.keys import root_queue, weights_key
from producer.contract.lua import LuaScript
from worker.rq_scripts import CHARGE_LUA, PICK_LUA, UTIL_LUA

# ARGV after the named ones: the base queues. Pops one job, as a dequeue of one does.
PICK = LuaScript(
    "pick",
    args=("aging_s", "max_wait_s"),
    libraries=(UTIL_LUA, PICK_LUA),
    body="""
local bases = {}
for i = REST, #ARGV do bases[#bases + 1] = ARGV[i] end
local P = pq_picker(bases, 1, 32)
local picked = pq_pick(P, tonumber(a_aging_s), tonumber(a_max_wait_s))
pq_commit(P)
if not picked then return nil end
return {picked.queue, picked.id, picked.base, picked.tenant, tostring(picked.cost)}
""",
)
CHARGE = LuaScript(
    "charge",
    args=("root", "tenant", "estimated", "used"),
    libraries=(CHARGE_LUA,),
    body="""
local used = tonumber(a_used)
return pq_charge(a_root, a_tenant, used - tonumber(a_estimated), used)
""",
)


class FairQueue:
    """The fair pick and the end-of-job charge for some base queues."""

    def __init__(
        self, connection: Any, bases: list[str], aging_seconds: float = 60.0,
        max_wait_seconds: float = 600.0,
    ) -> None:  # fmt: skip
        self.connection = connection
        self.bases = bases
        self.aging_seconds = aging_seconds
        self.max_wait_seconds = max_wait_seconds
        self._pick = connection.register_script(PICK.source)
        self._charge = connection.register_script(CHARGE.source)

    def set_weights(self, weights: dict[str, float]) -> None:
        """Publish tenant weights, as workers do."""
        for key in {weights_key(b) for b in self.bases}:
            self.connection.hset(key, mapping={t: str(w) for t, w in weights.items()})

    def pick(self) -> tuple[str, str, str, str, int] | None:
        """Pop the next job: (queue name, job id, base, tenant, estimated cost), or None."""
        _, args = PICK.keys_and_args(
            args={"aging_s": self.aging_seconds, "max_wait_s": self.max_wait_seconds},
            rest=self.bases,
        )
        out = self._pick(args=args)
        if not out:
            return None
        name, job_id, base, tenant, cost = (x.decode() if isinstance(x, bytes) else x for x in out)
        return name, job_id, base, tenant, int(float(cost))

    def charge(self, base: str, tenant: str, estimated_cost: int, tokens: int) -> None:
        """Replace a job's estimated cost by the tokens it used, in its tenant's account."""
        _, args = CHARGE.keys_and_args(
            args={
                "root": root_queue(base),
                "tenant": tenant,
                "estimated": estimated_cost,
                "used": tokens,
            }
        )
        self._charge(args=args)
