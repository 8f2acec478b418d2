"""Which job any worker takes next: priority with aging across the queue, then tenant fairness.

The choice runs inside Redis (Lua), atomically with the pop, so every worker on every host sees
the same order and the same tenant accounts. Per base queue (see ``producer/routing.py``):

1. Every non-empty sub-queue offers its head job. Its effective priority is
   ``priority - floor(waited / aging_seconds)``: lower runs sooner, and a waiting job gains one
   level every ``aging_seconds``, so a job of priority p starts at the latest
   ``(p - p_min + 1) * aging_seconds`` after it reaches the head of its sub-queue.
2. Among heads of the same effective priority, fair queueing by tenant, in tokens: a tenant's
   next job starts at its last finish tag ``S = F[tenant]`` and finishes at
   ``F = S + cost / weight`` (virtual time). The smallest ``F`` wins, after the seed's
   starvation boost ``V + (F - V) * (1 - 0.3 * min(1, waited / max_wait_seconds))``; then the
   earliest enqueue. Picking a job sets ``V = max(V, S)`` and ``F[tenant] = F``. When a job
   lands in an empty sub-queue (its tenant had been idle), the producer lifts ``F[tenant]`` to
   ``V``: an idle tenant shares from now on, it does not catch up on past service.
3. When the job ends, ``charge`` replaces its estimated cost by the tokens it really used.
"""

from __future__ import annotations

from typing import Any

from producer.keys import KEY_PREFIX
from producer.routing import DEFAULT_JOB_COST, weights_key

# Defaults a worker passes unless configured: a level of priority per minute of waiting, and the
# seed's full starvation boost after ten minutes.
DEFAULT_AGING_SECONDS = 60.0
DEFAULT_MAX_WAIT_SECONDS = 600.0

PICK_LUA = f"""
-- pq_pick(bases, aging_s, max_wait_s): pop the next job id across the sub-queues of `bases`.
-- Returns {{queue name, job id, base, tenant, cost}} or nil when every sub-queue is empty.
local function pq_pick(bases, aging_s, max_wait_s)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  local best = nil
  for _, base in ipairs(bases) do
    local index = '{KEY_PREFIX}:subqueues:' .. base
    -- One account per tenant for the whole queue: a model's queue shares its root's accounts.
    local root = string.match(base, '^[^@]*')
    local fair = '{KEY_PREFIX}:fair:' .. root
    local v = tonumber(redis.call('HGET', fair, 'v')) or 0
    local entries = redis.call('HGETALL', index)
    -- The base queue itself is always a candidate: plain RQ producers push there unindexed.
    local listed = false
    for i = 1, #entries, 2 do if entries[i] == base then listed = true end end
    if not listed then
      entries[#entries + 1] = base
      entries[#entries + 1] = '{{"priority":0,"tenant":""}}'
    end
    for i = 1, #entries, 2 do
      local name = entries[i]
      local ok, meta = pcall(cjson.decode, entries[i + 1])
      local qkey = 'rq:queue:' .. name
      local head = redis.call('LINDEX', qkey, 0)
      if not head or not ok or type(meta) ~= 'table' then
        if not head and name ~= base then redis.call('HDEL', index, name) end
      else
        local fields = redis.call('HMGET', 'rq:job:' .. head, 'pq_enq', 'pq_cost')
        local enq = tonumber(fields[1]) or now
        local cost = tonumber(fields[2]) or {DEFAULT_JOB_COST}
        local waited = math.max(0, now - enq)
        local prio = tonumber(meta.priority) or 0
        if aging_s > 0 then prio = prio - math.floor(waited / aging_s) end
        local tenant = tostring(meta.tenant or '')
        local w = tonumber(redis.call('HGET', '{KEY_PREFIX}:fair-weights:' .. root, tenant)) or 1
        if w <= 0 then w = 1 end
        -- A tenant's start tag is its last finish; producers lift it to V when the tenant's
        -- sub-queue was empty (it had been idle). A tenant never seen starts at V.
        local start = tonumber(redis.call('HGET', fair, 'F:' .. tenant)) or v
        local finish = start + cost / w
        local key = v + (finish - v) * (1 - 0.3 * math.min(1, waited / max_wait_s))
        if best == nil or prio < best.prio or (prio == best.prio and (key < best.key
            or (key == best.key and enq < best.enq))) then
          best = {{prio = prio, key = key, enq = enq, name = name, qkey = qkey, fair = fair,
                  base = base, tenant = tenant, start = start, finish = finish, cost = cost}}
        end
      end
    end
  end
  if best == nil then return nil end
  local id = redis.call('LPOP', best.qkey)
  local v = tonumber(redis.call('HGET', best.fair, 'v')) or 0
  redis.call('HSET', best.fair, 'v', tostring(math.max(v, best.start)), 'F:' .. best.tenant,
             tostring(best.finish))
  return {{best.name, id, best.base, best.tenant, tostring(best.cost)}}
end
"""

# Standalone: KEYS unused (the sub-queue keys are found through the index; single-node Redis).
# ARGV = aging_s, max_wait_s, base1, base2, ...
PICK_SCRIPT = (
    PICK_LUA
    + """
local bases = {}
for i = 3, #ARGV do bases[#bases + 1] = ARGV[i] end
return pq_pick(bases, tonumber(ARGV[1]), tonumber(ARGV[2]))
"""
)

CHARGE_LUA = f"""
-- pq_charge(base, tenant, estimated, used): replace a job's estimated cost by the tokens it used.
local function pq_charge(base, tenant, estimated, used)
  local root = string.match(base, '^[^@]*')
  local fair = '{KEY_PREFIX}:fair:' .. root
  local w = tonumber(redis.call('HGET', '{KEY_PREFIX}:fair-weights:' .. root, tenant)) or 1
  if w <= 0 then w = 1 end
  local finish = tonumber(redis.call('HGET', fair, 'F:' .. tenant))
  if finish then
    redis.call('HSET', fair, 'F:' .. tenant, tostring(finish + (used - estimated) / w))
  end
  if used > 0 then redis.call('HINCRBY', '{KEY_PREFIX}:tenant-tokens:' .. root, tenant, used) end
end
"""

# ARGV = base, tenant, estimated cost, tokens used.
CHARGE_SCRIPT = (
    CHARGE_LUA
    + """
return pq_charge(ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]))
"""
)


def publish_weights(connection: Any, bases: list[str], weights: dict[str, float]) -> None:
    """Write tenant weights once per root queue of ``bases`` (model queues share their root's)."""
    keys = sorted({weights_key(base) for base in bases})
    if weights and keys:
        with connection.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hset(key, mapping={t: str(w) for t, w in weights.items()})
            pipe.execute()


class FairQueue:
    """The fair pick and the end-of-job charge for the base queues one worker serves."""

    def __init__(
        self,
        connection: Any,
        bases: list[str],
        aging_seconds: float = DEFAULT_AGING_SECONDS,
        max_wait_seconds: float = DEFAULT_MAX_WAIT_SECONDS,
    ) -> None:
        self.connection = connection
        self.bases = bases
        self.aging_seconds = aging_seconds
        self.max_wait_seconds = max_wait_seconds
        self._pick = connection.register_script(PICK_SCRIPT)
        self._charge = connection.register_script(CHARGE_SCRIPT)

    def set_weights(self, weights: dict[str, float]) -> None:
        """Publish tenant weights (shared by every worker of these queues; last writer wins)."""
        publish_weights(self.connection, self.bases, weights)

    def pick(self) -> tuple[str, str, str, str, int] | None:
        """Pop the next job: (queue name, job id, base, tenant, estimated cost), or None."""
        out = self._pick(args=[self.aging_seconds, self.max_wait_seconds, *self.bases])
        if not out:
            return None
        name, job_id, base, tenant, cost = (_text(x) for x in out)
        return name, job_id, base, tenant, int(float(cost))

    def charge(
        self, base: str, tenant: str, estimated_cost: int, tokens: int, pipeline: Any = None
    ) -> None:
        """Replace a job's estimated cost by the tokens it used, in its tenant's account."""
        self._charge(args=[base, tenant, estimated_cost, tokens], client=pipeline)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
