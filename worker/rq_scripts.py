"""The Lua scripts through which a worker changes RQ's state: each one step, atomic in Redis.

They write what RQ's tooling reads (job hash, registries, result stream, worker registration)
and nothing else: no callback, dependency or webhook of RQ is ever looked at. Every script that
ends or streams a job is fenced: it first checks that the job is still `started` under the
caller's execution id (the job hash's `F.execution`), and writes nothing otherwise. Keys come
from the contract's prefix tables (`K`, `RQ`, `F`: producer/contract/lua.py), arguments by name.

Which job any worker takes next (`pq_pick`, in DEQUEUE): priority with aging across the queue,
then tenant fairness. Per base queue (producer/contract/routing.py):

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
3. When the job ends, ``pq_charge`` replaces its estimated cost by the tokens it really used.
"""

from __future__ import annotations

from producer.contract.lua import LuaScript
from producer.contract.routing import DEFAULT_JOB_COST

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
    local index = K.subqueues .. base
    -- One account per tenant for the whole queue: a model's queue shares its root's accounts.
    local root = string.match(base, '^[^@]*')
    local fair = K.fair .. root
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
      local qkey = RQ.queue .. name
      local head = redis.call('LINDEX', qkey, 0)
      if not head or not ok or type(meta) ~= 'table' then
        if not head and name ~= base then redis.call('HDEL', index, name) end
      else
        local fields = redis.call('HMGET', RQ.job .. head, F.enqueued, F.cost)
        local enq = tonumber(fields[1]) or now
        local cost = tonumber(fields[2]) or {DEFAULT_JOB_COST}
        local waited = math.max(0, now - enq)
        local prio = tonumber(meta.priority) or 0
        if aging_s > 0 then prio = prio - math.floor(waited / aging_s) end
        local tenant = tostring(meta.tenant or '')
        local w = tonumber(redis.call('HGET', K.fair_weights .. root, tenant)) or 1
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

CHARGE_LUA = """
-- pq_charge(base, tenant, estimated, used): replace a job's estimated cost by the tokens it used.
local function pq_charge(base, tenant, estimated, used)
  local root = string.match(base, '^[^@]*')
  local fair = K.fair .. root
  local w = tonumber(redis.call('HGET', K.fair_weights .. root, tenant)) or 1
  if w <= 0 then w = 1 end
  local finish = tonumber(redis.call('HGET', fair, 'F:' .. tenant))
  if finish then
    redis.call('HSET', fair, 'F:' .. tenant, tostring(finish + (used - estimated) / w))
  end
  if used > 0 then redis.call('HINCRBY', K.tenant_tokens .. root, tenant, used) end
end
"""

# `held` is the fence, `end_job` the one way a job ends.
END_LUA = """
local function held(jkey, execution)
    local f = redis.call('HMGET', jkey, 'status', F.execution)
    return f[1] == 'started' and f[2] == execution
end

-- Puts a requeued job's sub-queue back in its base's index (the fair pick drops empty ones).
local function reindex(jkey, queue)
    local f = redis.call('HMGET', jkey, F.base, F.meta)
    if f[1] and f[2] and f[1] ~= queue then
        redis.call('HSET', K.subqueues .. f[1], queue, f[2])
    end
end

local function slice(t, first, count)
    local out = {}
    for i = first, first + count - 1 do out[#out + 1] = t[i] end
    return out
end

-- Counts a gateway batch line's end in its batch's counts hash, only while that hash exists:
-- finished / failed / canceled, and the tokens of a finished one.
local function count_in_batch(jkey, status, prompt_tokens, completion_tokens)
    local batch = redis.call('HGET', jkey, F.batch)
    if not batch then return end
    local ckey = K.batch_counts .. batch
    if redis.call('EXISTS', ckey) == 0 then return end
    redis.call('HINCRBY', ckey, status, 1)
    if status == 'finished' then
        redis.call('HINCRBY', ckey, 'prompt_tokens', prompt_tokens)
        redis.call('HINCRBY', ckey, 'completion_tokens', completion_tokens)
    end
end

-- Ends a started job: RQ status, registries, RQ result entry, pagedq result key, final entry,
-- the tenant's charge (the tokens it used), its batch's counts, and the ending worker's RQ
-- counters (worker_key '' for the reaper: the worker is dead).
local function end_job(job_id, queue, member, status, ended_at, score, ttl, result_json,
                       prompt_tokens, completion_tokens, rq_fields, final_fields, stream_ttl,
                       maxlen, worker_key)
    local used = prompt_tokens + completion_tokens
    local jkey = RQ.job .. job_id
    local counter = ({finished = 'successful_job_count', failed = 'failed_job_count'})[status]
    if worker_key ~= '' and counter then redis.call('HINCRBY', worker_key, counter, 1) end
    redis.call('ZREM', RQ.wip .. queue, member)
    redis.call('HSET', jkey, 'status', status, 'ended_at', ended_at)
    redis.call('EXPIRE', jkey, ttl)
    redis.call('ZADD', RQ[status] .. queue, score, job_id)
    if #rq_fields > 0 then
        local rkey = RQ.results .. job_id
        redis.call('XADD', rkey, 'MAXLEN', '10', '*', unpack(rq_fields))
        redis.call('EXPIRE', rkey, ttl)
    end
    local f = redis.call('HMGET', jkey, F.base, F.tenant, F.cost)
    if f[1] then pq_charge(f[1], f[2] or '', tonumber(f[3]) or used, used) end
    count_in_batch(jkey, status, prompt_tokens, completion_tokens)
    redis.call('SET', K.result .. job_id, result_json, 'EX', ttl)
    local skey = K.stream .. job_id
    redis.call('XADD', skey, 'MAXLEN', '~', maxlen, '*', unpack(final_fields))
    -- stream_ttl '0': the stream's TTL was set with its first entry of this run.
    if stream_ttl ~= '0' then redis.call('EXPIRE', skey, stream_ttl) end
end
"""

# What ends a job, after the job's own (job_id, queue, execution): END's and REQUEUE's tail.
# `result` is the GenerationResult JSON, and `prompt_tokens`, `completion_tokens` its usage (what
# the tenant is charged and the batch counts), so the script never parses the result; the rest
# of ARGV holds `n_rq` field/values of RQ's result entry, then `n_final` of the final entry.
ENDING_ARGS = (
    "status",
    "ended_at",
    "score",
    "ttl",
    "result",
    "prompt_tokens",
    "completion_tokens",
    "stream_ttl",
    "maxlen",
    "n_rq",
    "n_final",
)
_END_JOB_CALL = """
    end_job(a_job_id, a_queue, a_job_id .. ':' .. a_execution, STATUS, a_ended_at, a_score,
        a_ttl, a_result, tonumber(a_prompt_tokens), tonumber(a_completion_tokens),
        slice(ARGV, REST, tonumber(a_n_rq)),
        slice(ARGV, REST + tonumber(a_n_rq), tonumber(a_n_final)), a_stream_ttl, a_maxlen,
        k_worker)
"""

# KEYS after the named ones: the base queue keys the worker serves (its model's, the generic).
# Picks the next job across the sub-queues of those bases, pops it and marks it started under a
# lease, in one step: a worker killed at any instant leaves the job either queued or visible in
# the started registry. Returns {queue, job_id, attempt, data, enqueued_at, timeout, canceled,
# prior status} or false.
DEQUEUE = LuaScript(
    "dequeue",
    args=(
        "now",
        "lease_ttl",
        "worker_name",
        "execution",
        "started_at",
        "max_pops",
        "aging_s",
        "max_wait_s",
    ),
    libraries=(PICK_LUA,),
    body="""
local bases = {}
for i = KEYS_REST, #KEYS do bases[#bases + 1] = string.sub(KEYS[i], string.len(RQ.queue) + 1) end
for _ = 1, tonumber(a_max_pops) do
    local picked = pq_pick(bases, tonumber(a_aging_s), tonumber(a_max_wait_s))
    if not picked then break end
    local queue, job_id = picked[1], picked[2]
    local jkey = RQ.job .. job_id
    local f = redis.call('HMGET', jkey, 'status', 'data', 'enqueued_at', 'timeout', F.attempts)
    -- A hash without status but with data is started too, so that it fails with a reason.
    if f[1] == 'queued' or (not f[1] and f[2]) then
        local attempt = (tonumber(f[5]) or 0) + 1
        redis.call('HSET', jkey, 'status', 'started', 'started_at', a_started_at,
            'last_heartbeat', a_started_at, 'worker_name', a_worker_name,
            F.execution, a_execution, F.attempts, attempt, F.base, picked[3],
            F.tenant, picked[4], F.cost, picked[5])
        redis.call('ZADD', RQ.wip .. queue, tonumber(a_now) + tonumber(a_lease_ttl),
            job_id .. ':' .. a_execution)
        local canceled = redis.call('EXISTS', K.cancel .. job_id)
        return {queue, job_id, attempt, f[2] or '', f[3] or '', f[4] or '', canceled,
            f[1] or ''}
    end
    -- Anything else is a stale entry (job gone, canceled, or already run): dropped.
end
return false
""",
)

# Ends a held job as finished, failed or canceled. Returns 1 when ended, 0 when this
# execution no longer holds it (nothing written).
END = LuaScript(
    "end",
    keys=("worker",),
    args=("job_id", "queue", "execution", *ENDING_ARGS),
    libraries=(CHARGE_LUA, END_LUA),
    body="""
if not held(RQ.job .. a_job_id, a_execution) then return 0 end
local STATUS = a_status
"""
    + _END_JOB_CALL
    + "return 1\n",
)

# Puts a held job back at the front of its queue (a graceful stop, or an engine crash that
# counts against the job); ENDING_ARGS describe the failure written when the crash count
# reaches max_crashes. Returns 1 requeued, 2 failed (too many crashes), 0 not held.
REQUEUE = LuaScript(
    "requeue",
    keys=("worker",),
    args=("job_id", "queue", "execution", "count_crash", "max_crashes", *ENDING_ARGS),
    libraries=(CHARGE_LUA, END_LUA),
    body="""
local jkey = RQ.job .. a_job_id
if not held(jkey, a_execution) then return 0 end
if a_count_crash == '1' then
    local crashes = redis.call('HINCRBY', jkey, F.crashes, 1)
    if crashes >= tonumber(a_max_crashes) then
        local STATUS = 'failed'
"""
    + _END_JOB_CALL
    + """
        return 2
    end
end
redis.call('ZREM', RQ.wip .. a_queue, a_job_id .. ':' .. a_execution)
redis.call('HSET', jkey, 'status', 'queued')
redis.call('LPUSH', RQ.queue .. a_queue, a_job_id)
reindex(jkey, a_queue)
return 1
""",
)

# ARGV after the named ones, per job: job_id, execution, set_ttl (0/1), n, n field/values.
# Appends one step's token entries, each only if its execution still holds the job.
# Returns the job ids whose entries were refused (the lease was lost).
STREAM = LuaScript(
    "stream",
    args=("maxlen", "stream_ttl"),
    libraries=(CHARGE_LUA, END_LUA),
    body="""
local lost = {}
local i = REST
while i <= #ARGV do
    local job_id, execution, set_ttl, n = ARGV[i], ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3])
    if held(RQ.job .. job_id, execution) then
        local skey = K.stream .. job_id
        redis.call('XADD', skey, 'MAXLEN', '~', a_maxlen, '*', unpack(slice(ARGV, i + 4, n)))
        if set_ttl == '1' then redis.call('EXPIRE', skey, a_stream_ttl) end
    else
        lost[#lost + 1] = job_id
    end
    i = i + 4 + n
end
return lost
""",
)

# ARGV after the named ones: (queue, member) pairs of every held execution.
# Renews every lease (ZADD XX CH: 0 means the entry is gone, the lease was lost) and the
# worker's registration. Returns the members whose lease was lost.
HEARTBEAT = LuaScript(
    "heartbeat",
    keys=("worker",),
    args=("lease_deadline", "worker_ttl", "now", "last_heartbeat", "state"),
    body="""
local lost = {}
for i = REST, #ARGV, 2 do
    if redis.call('ZADD', RQ.wip .. ARGV[i], 'XX', 'CH', a_lease_deadline, ARGV[i + 1]) == 0 then
        lost[#lost + 1] = ARGV[i + 1]
    end
end
redis.call('HSET', k_worker, 'last_heartbeat', a_last_heartbeat, 'pagedq_heartbeat', a_now,
    'state', a_state)
redis.call('EXPIRE', k_worker, a_worker_ttl)
return lost
""",
)

# KEYS after the named ones: the started registries (RQ.wip .. queue) of the worker's queues.
# Our replacement for RQ's StartedJobRegistry.cleanup: an expired lease means the worker
# holding it died; its job goes back to the queue front, or fails once it was in flight
# during max_crashes crashes. Also drops expired finished/failed/canceled registry entries.
# With a `holder` (a worker name; '' for any) and `until` '+inf', it takes every lease of a
# worker known to be dead, expired or not. Returns {requeued job ids, failed job ids}.
REAP = LuaScript(
    "reap",
    args=(
        "now",
        "until",
        "holder",
        "max_crashes",
        "ended_at",
        "failure_ttl",
        "exc_string",
        "reason",
        "stream_ttl",
        "maxlen",
        "limit",
    ),
    libraries=(CHARGE_LUA, END_LUA),
    body="""
local now, max_crashes = tonumber(a_now), tonumber(a_max_crashes)
local requeued, failed = {}, {}
for k = KEYS_REST, #KEYS do
    local wip = KEYS[k]
    local queue = string.sub(wip, string.len(RQ.wip) + 1)
    local expired = redis.call('ZRANGEBYSCORE', wip, '-inf', a_until, 'LIMIT', 0,
        tonumber(a_limit))
    for _, member in ipairs(expired) do
        local sep = string.find(member, ':[^:]*$')
        local job_id, execution, jkey, mine = nil, nil, nil, true
        if sep then
            job_id, execution = string.sub(member, 1, sep - 1), string.sub(member, sep + 1)
            jkey = RQ.job .. job_id
            if a_holder ~= '' then
                mine = redis.call('HGET', jkey, 'worker_name') == a_holder
            end
        end
        if sep and mine then
            if held(jkey, execution) then
                local crashes = redis.call('HINCRBY', jkey, F.crashes, 1)
                if crashes >= max_crashes then
                    local result = cjson.encode({job_id = job_id, status = 'failed',
                        error = a_reason})
                    end_job(job_id, queue, member, 'failed', a_ended_at,
                        now + tonumber(a_failure_ttl), a_failure_ttl, result, 0, 0,
                        {'type', RESULT.failed, 'worker_name', '', 'exc_string', a_exc_string},
                        {'event', 'error', 'error', a_reason}, a_stream_ttl, a_maxlen, '')
                    failed[#failed + 1] = job_id
                else
                    redis.call('HSET', jkey, 'status', 'queued')
                    redis.call('LPUSH', RQ.queue .. queue, job_id)
                    reindex(jkey, queue)
                    requeued[#requeued + 1] = job_id
                end
            end
        end
        if mine then redis.call('ZREM', wip, member) end
    end
    for _, registry in ipairs({'finished', 'failed', 'canceled'}) do
        redis.call('ZREMRANGEBYSCORE', RQ[registry] .. queue, '-inf', now)
    end
end
return {requeued, failed}
""",
)

# KEYS after the named ones: RQ's per-queue worker sets (RQ.workers_of .. queue).
# ARGV after the named ones: `n_fields` field/values of the worker hash, then the queue keys to
# add to RQ's set of queues. Registers the worker like RQ's register_birth, but takes over a
# registration under the same name whose heartbeat is older than a lease (its process died).
# Returns 1, or 0 if it is live.
REGISTER = LuaScript(
    "register",
    keys=("worker", "workers"),
    args=("now", "lease_ttl", "key_ttl", "n_fields"),
    body="""
if redis.call('EXISTS', k_worker) == 1 then
    local f = redis.call('HMGET', k_worker, 'death', 'pagedq_heartbeat')
    if not f[1] and (not f[2] or tonumber(a_now) - tonumber(f[2]) < tonumber(a_lease_ttl)) then
        return 0
    end
end
redis.call('DEL', k_worker)
local n = tonumber(a_n_fields)
redis.call('HSET', k_worker, unpack(ARGV, REST, REST + n - 1))
redis.call('EXPIRE', k_worker, a_key_ttl)
redis.call('SADD', k_workers, k_worker)
for k = KEYS_REST, #KEYS do redis.call('SADD', KEYS[k], k_worker) end
if #ARGV >= REST + n then redis.call('SADD', RQ.queues, unpack(ARGV, REST + n)) end
return 1
""",
)

SCRIPTS = (DEQUEUE, END, REQUEUE, STREAM, HEARTBEAT, REAP, REGISTER)
