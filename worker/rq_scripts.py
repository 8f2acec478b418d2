"""The Lua scripts through which a worker changes RQ's state: each one step, atomic in Redis.

They write what RQ's tooling reads (job hash, registries, result stream, worker registration)
and nothing else: no callback, dependency or webhook of RQ is ever looked at. Every script that
ends or streams a job is fenced: it first checks that the job is still `started` under the
caller's execution id (the job hash's `F.execution`; STREAM, called every window, checks that
no reaper took a lease of the worker's there since it last looked, its lease fence, and only
then each execution's member in the started registry), and writes nothing otherwise. Keys come
from the contract's prefix tables (`K`, `RQ`, `F`: producer/contract/lua.py, written into each
source as literals), arguments by name.

Each call is about one queue shard (producer/contract/shards.py): its KEYS are keys of that
shard (queues, registries, job hashes), and every other key it touches is named after the
shard's queues or jobs, so all of them carry the shard's hash tag and hash to one Redis Cluster
slot. Only the queue heads and expired leases a script finds are not known to the caller; their
keys are built from the ids found, which carry the tag. The worker's own RQ hash is another
slot: a call writes its counters only on one Redis, unsharded (`counters` 1, its key the last
of KEYS).

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

Redis's work grows with jobs, not with workers or tokens: one DEQUEUE takes every job the
worker can admit now (each sub-queue's state read once, each list popped once), one END ends
every job the worker gathered (worker/coalesce.py; registry moves, worker counters and tenant
charges written once per call), and one HEARTBEAT renews every lease with one ZMSCORE and one
ZADD per queue. A job alone costs the job hash read and written at its start, and at its end
the hash read, written and given its TTL, and its result set: docs/OPERATIONS.md counts the
rest.
"""

from __future__ import annotations

from producer.contract.keys import (
    EVENTS_MAXLEN,
    EXECUTION_PREFIX_CHARS,
    FENCE_TTL_S,
    WAKE_MAXLEN,
    WAKE_RETAIN_MS,
)
from producer.contract.lua import RING_BELL_LUA, LuaScript
from producer.contract.routing import DEFAULT_JOB_COST
from producer.contract.stream import DELTAS_WAKE, ENTRIES_FIELD, INLINE_WAKE

# Defaults a worker passes unless configured: a level of priority per minute of waiting, and the
# seed's full starvation boost after ten minutes.
DEFAULT_AGING_SECONDS = 60.0
DEFAULT_MAX_WAIT_SECONDS = 600.0

UTIL_LUA = (
    RING_BELL_LUA
    + f"""
-- Appends values to the list t[k], creating it.
local function push(t, k, ...)
    local l = t[k]
    if not l then l = {{}}; t[k] = l end
    local n = select('#', ...)
    if n == 1 then  -- the hot case, without a table per call
        l[#l + 1] = ...
        return
    end
    for i = 1, n do l[#l + 1] = select(i, ...) end
end

local function slice(t, first, count)
    local out = {{}}
    for i = first, first + count - 1 do out[#out + 1] = t[i] end
    return out
end

-- The leases still held among `by_queue` (queue -> started-registry members): member -> its
-- deadline, one ZMSCORE per queue. A member leaves the registry however its job stops being
-- held (end, requeue, reap), so presence is the lease.
local function held_leases(by_queue)
    local held = {{}}
    for queue, members in pairs(by_queue) do
        local scores = redis.call('ZMSCORE', RQ.wip .. queue, unpack(members))
        for j, member in ipairs(members) do
            if scores[j] then held[member] = scores[j] end
        end
    end
    return held
end

-- Tells the worker that started `execution` that a lease of its jobs in `queue` was taken from
-- it: its next STREAM call checks every lease there (see STREAM).
local function bump_fence(queue, execution)
    local fence = K.fence .. queue .. ':' .. string.sub(execution, 1, {EXECUTION_PREFIX_CHARS})
    redis.call('INCR', fence)
    redis.call('EXPIRE', fence, {FENCE_TTL_S})
end
"""
)

PICK_LUA = f"""
-- The job hash fields a head is judged and started by.
local HEAD = {{F.enqueued, F.cost, 'status', 'data', 'enqueued_at', 'timeout', F.attempts,
    F.notify, F.batch, F.wake}}

-- A bulk job (its HEAD fields `f`): its end is read from an events stream or a batch's
-- counts, nobody waits on it alone.
local function pq_bulk(f)
    return (f[8] or f[9]) and true or false
end

-- A picker over the sub-queues of `bases`: each sub-queue's index entry, its first `peek` ids
-- and each root's virtual time are read once; pq_pick then picks job after job exactly as
-- one call per job would, and pq_commit pops what was taken and writes the accounts.
local function pq_picker(bases, peek, max_stale)
    local t = redis.call('TIME')
    local P = {{now = tonumber(t[1]) + tonumber(t[2]) / 1000000, subs = {{}}, fair = {{}},
               weights = {{}}, peek = peek, stale = 0, max_stale = max_stale}}
    for _, base in ipairs(bases) do
        local index = K.subqueues .. base
        -- One account per tenant for the whole queue: a model's queue shares its root's.
        local root = string.match(base, '^[^@]*')
        local fkey = K.fair .. root
        if not P.fair[fkey] then
            P.fair[fkey] = {{key = fkey, v = tonumber(redis.call('HGET', fkey, 'v')) or 0,
                            F = {{}}, dirty = {{}}}}
        end
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
            local ids = redis.call('LRANGE', qkey, 0, peek - 1)
            if #ids == 0 then
                if name ~= base then redis.call('HDEL', index, name) end
            elseif ok and type(meta) == 'table' then
                P.subs[#P.subs + 1] = {{name = name, qkey = qkey, base = base, root = root,
                    fair = P.fair[fkey], prio = tonumber(meta.priority) or 0,
                    tenant = tostring(meta.tenant or ''), ids = ids, pos = 1,
                    done = #ids < peek}}
            end
        end
    end
    return P
end

-- The runnable head of a sub-queue (its job hash fields read once), skipping stale entries
-- (job gone, canceled, or already run: popped with the rest); nil when none is left.
local function pq_head(P, sub)
    while not sub.head do
        if sub.pos > #sub.ids then
            if sub.done then return nil end
            local more = redis.call('LRANGE', sub.qkey, #sub.ids, #sub.ids + P.peek - 1)
            sub.done = #more < P.peek
            if #more == 0 then return nil end
            for _, id in ipairs(more) do sub.ids[#sub.ids + 1] = id end
        end
        local id = sub.ids[sub.pos]
        local f = redis.call('HMGET', RQ.job .. id, unpack(HEAD))
        -- A hash without status but with data is started too, so that it fails with a reason.
        if f[3] == 'queued' or (not f[3] and f[4]) then
            -- Parsed once: every pick compares every head.
            local cost = tonumber(f[2])
            sub.head = {{id = id, f = f, enq = tonumber(f[1]) or P.now,
                        cost = cost or {DEFAULT_JOB_COST},
                        cost_text = cost and f[2] or '{DEFAULT_JOB_COST}'}}
        else
            sub.pos = sub.pos + 1
            P.stale = P.stale + 1
            if P.stale > P.max_stale then return nil end
        end
    end
    return sub.head
end

local function pq_weight(P, root, tenant)
    local k = root .. '/' .. tenant
    if P.weights[k] == nil then
        local w = tonumber(redis.call('HGET', K.fair_weights .. root, tenant)) or 1
        if w <= 0 then w = 1 end
        P.weights[k] = w
    end
    return P.weights[k]
end

-- A tenant's start tag is its last finish; producers lift it to V when the tenant's sub-queue
-- was empty (it had been idle). A tenant never seen starts at V.
local function pq_start(fair, tenant)
    if fair.F[tenant] == nil then
        fair.F[tenant] = tonumber(redis.call('HGET', fair.key, 'F:' .. tenant)) or false
    end
    return fair.F[tenant] or fair.v
end

-- A head's priority after aging: lower runs sooner.
local function pq_aged(P, sub, h, aging_s)
    local waited = math.max(0, P.now - h.enq)
    if aging_s > 0 then return sub.prio - math.floor(waited / aging_s) end
    return sub.prio
end

-- The best aged priority among the heads, or nil when every sub-queue is empty.
local function pq_best(P, aging_s)
    local best = nil
    for _, sub in ipairs(P.subs) do
        local h = pq_head(P, sub)
        if h then
            local prio = pq_aged(P, sub, h, aging_s)
            if best == nil or prio < best then best = prio end
        end
    end
    return best
end

-- Queued ids the picker has not consumed yet (stale ones included): math.huge when a
-- sub-queue holds more than it read.
local function pq_left(P)
    local n = 0
    for _, sub in ipairs(P.subs) do
        if not sub.done then return math.huge end
        n = n + #sub.ids - sub.pos + 1
    end
    return n
end

-- The next job across the picker's sub-queues: {{queue, id, base, tenant, cost, cost_text,
-- f}}, or nil
-- (also when the best head's aged priority is above `limit`, if given, or when `bulk_only`
-- and the best head is a job somebody waits on alone: it stays queued).
local function pq_pick(P, aging_s, max_wait_s, limit, bulk_only)
    local best = nil
    for _, sub in ipairs(P.subs) do
        local h = pq_head(P, sub)
        if h then
            local enq = h.enq
            local cost = h.cost
            local waited = math.max(0, P.now - enq)
            local prio = pq_aged(P, sub, h, aging_s)
            local v = sub.fair.v
            local start = pq_start(sub.fair, sub.tenant)
            local finish = start + cost / pq_weight(P, sub.root, sub.tenant)
            local key = v + (finish - v) * (1 - 0.3 * math.min(1, waited / max_wait_s))
            if best == nil or prio < best.prio or (prio == best.prio and (key < best.key
                or (key == best.key and enq < best.enq))) then
                best = {{prio = prio, key = key, enq = enq, sub = sub, start = start,
                        finish = finish, cost = cost}}
            end
        end
    end
    if best == nil or (limit and best.prio > limit) then return nil end
    local sub = best.sub
    local h = sub.head
    if bulk_only and not pq_bulk(h.f) then return nil end
    sub.head = nil
    sub.pos = sub.pos + 1
    sub.fair.v = math.max(sub.fair.v, best.start)
    sub.fair.F[sub.tenant] = best.finish
    sub.fair.dirty[sub.tenant] = true
    return {{queue = sub.name, id = h.id, base = sub.base, tenant = sub.tenant,
            cost = best.cost, cost_text = h.cost_text, f = h.f}}
end

-- The bases with queued ids the picker has not consumed (stale ones included).
local function pq_left_bases(P)
    local left = {{}}
    for _, sub in ipairs(P.subs) do
        if not sub.done or sub.pos <= #sub.ids then left[sub.base] = true end
    end
    return left
end

-- Pops what the picks consumed (taken and stale entries) and writes the accounts they moved.
local function pq_commit(P)
    for _, sub in ipairs(P.subs) do
        if sub.pos > 1 then redis.call('LPOP', sub.qkey, sub.pos - 1) end
    end
    for _, fair in pairs(P.fair) do
        local args = {{}}
        for tenant in pairs(fair.dirty) do
            args[#args + 1] = 'F:' .. tenant
            args[#args + 1] = tostring(fair.F[tenant])
        end
        if #args > 0 then redis.call('HSET', fair.key, 'v', tostring(fair.v), unpack(args)) end
    end
end
"""

CHARGE_LUA = """
-- pq_charge(root, tenant, delta, used): replace the estimated cost of a tenant's jobs by the
-- tokens they used (`delta` = used - estimated, summed over the jobs of one call). The finish
-- tag moves in Redis (HINCRBYFLOAT: no read, no float printed in Lua); the pick that started
-- the jobs wrote it.
local function pq_charge(root, tenant, delta, used)
    if delta ~= 0 then
        local w = tonumber(redis.call('HGET', K.fair_weights .. root, tenant)) or 1
        if w <= 0 then w = 1 end
        redis.call('HINCRBYFLOAT', K.fair .. root, 'F:' .. tenant, delta / w)
    end
    if used > 0 then redis.call('HINCRBY', K.tenant_tokens .. root, tenant, used) end
end
"""

# `job_state` and `held_by` are the fence, `end_job` the one way a job ends, `flush` what a
# call's endings write together.
END_LUA = f"""
local function job_state(jkey)
    local f = redis.call('HMGET', jkey, 'status', F.execution, F.base, F.tenant, F.cost,
        F.batch, F.notify, F.wake)
    return {{status = f[1], execution = f[2], base = f[3], tenant = f[4], cost = f[5],
            batch = f[6], notify = f[7], wake = f[8]}}
end

local function held_by(s, execution)
    return s.status == 'started' and s.execution == execution
end

-- A hub whose jobs' entries go into its wake stream, not into each job's stream.
local function is_inline(wake)
    local tail = string.match(wake, ':%a+$')
    return tail == '{INLINE_WAKE}' or tail == '{DELTAS_WAKE}'
end

-- An inline hub that takes a token entry as its delta alone, and its jobs from the entries.
local function takes_deltas(wake)
    return string.sub(wake, -{len(DELTAS_WAKE)}) == '{DELTAS_WAKE}'
end

-- Tells each stream hub in `wakes` (wake id -> job ids, or those ids joined by spaces) which of
-- its jobs got entries, and gives an inline hub the entries themselves (`inline`: wake id ->
-- JSON object of job id -> entries, or a list of its `"<job id>":[...]` members): one entry
-- per hub and call, not one per job (the hub reads an ended job's result from its result
-- key, which the worker staged: a result never passes through Lua). An inline stream keeps
-- the entries from `minid` on (ms: the caller's clock less {WAKE_RETAIN_MS} ms, as a lease's
-- deadline is the worker's clock; Redis's TIME and the arithmetic on its two strings cost a
-- call some 15,000 instructions), whatever the fleet writes. `ttl` '0' leaves each stream's
-- TTL alone: a worker renews it on its first call to a hub, then every quarter of the TTL
-- (RQAdapter.wake_args).
local function tell_wakes(wakes, inline, minid, ttl)
    for wake, ids in pairs(wakes) do
        local key, data = K.wake .. wake, inline[wake]
        if type(ids) == 'table' and not (data and takes_deltas(wake)) then
            ids = table.concat(ids, ' ')
        end
        if data then
            -- END's jobs: `"<job id>":[...]` each (end_job); STREAM's: their JSON object.
            if type(data) == 'table' then data = '{{' .. table.concat(data, ',') .. '}}' end
            local fields = {{'{ENTRIES_FIELD}', data}}
            -- A reader of deltas takes its jobs from the keys of the entries.
            if not takes_deltas(wake) then fields[3], fields[4] = 'jobs', ids end
            redis.call('XADD', key, 'MINID', '~', minid, '*', unpack(fields))
        else
            redis.call('XADD', key, 'MAXLEN', '~', {WAKE_MAXLEN}, '*', 'jobs', ids)
        end
        if ttl ~= '0' then redis.call('EXPIRE', key, ttl) end
    end
end

-- Puts a requeued job's sub-queue back in its base's index (the fair pick drops empty ones).
local function reindex(jkey, queue)
    local f = redis.call('HMGET', jkey, F.base, F.meta)
    if f[1] and f[2] and f[1] ~= queue then
        redis.call('HSET', K.subqueues .. f[1], queue, f[2])
    end
end

-- Counts a gateway batch line's end in its batch's counts hash, only while that hash exists:
-- finished / failed / canceled, and the tokens of a finished one.
local function count_in_batch(batch, status, prompt_tokens, completion_tokens)
    local ckey = K.batch_counts .. batch
    if redis.call('EXISTS', ckey) == 0 then return end
    redis.call('HINCRBY', ckey, status, 1)
    if status == 'finished' then
        redis.call('HINCRBY', ckey, 'prompt_tokens', prompt_tokens)
        redis.call('HINCRBY', ckey, 'completion_tokens', completion_tokens)
    end
end

-- The ending worker's RQ counter of each status that has one.
local COUNTERS = {{finished = 'successful_job_count', failed = 'failed_job_count'}}

local function new_acc()
    return {{zrem = {{}}, zadd = {{}}, counters = {{}}, charges = {{}}, wakes = {{}},
             inline = {{}}, ended_ids = {{}}, ended_statuses = {{}}}}
end

-- Ends a started job whose hash fields `s` were read: RQ status and TTL, RQ's result entry
-- (when given: jobs of plain RQ producers), pagedq's result key, the final stream entry (when
-- given: jobs that stream) and its batch's counts. Registry moves, the ending worker's
-- counters, the tenant's charge and the producer's and hub's notices go to `acc`, written by
-- `flush` (one events entry per producer and call).
local function end_job(acc, s, job_id, queue, member, status, ended_at, score, ttl,
                       result_json, prompt_tokens, completion_tokens, rq_fields,
                       final_fields, stream_ttl, maxlen, inline)
    local used = prompt_tokens + completion_tokens
    local jkey = RQ.job .. job_id
    local counter = COUNTERS[status]
    if counter then acc.counters[counter] = (acc.counters[counter] or 0) + 1 end
    push(acc.zrem, RQ.wip .. queue, member)
    redis.call('HSET', jkey, 'status', status, 'ended_at', ended_at)
    redis.call('EXPIRE', jkey, ttl)
    push(acc.zadd, RQ[status] .. queue, score, job_id)
    if #rq_fields > 0 then
        local rkey = RQ.results .. job_id
        redis.call('XADD', rkey, 'MAXLEN', '10', '*', unpack(rq_fields))
        redis.call('EXPIRE', rkey, ttl)
    end
    if s.base then
        local root, tenant = string.match(s.base, '^[^@]*'), s.tenant or ''
        local k = root .. '/' .. tenant
        local c = acc.charges[k]
        if not c then
            c = {{root = root, tenant = tenant, delta = 0, used = 0}}
            acc.charges[k] = c
        end
        c.delta = c.delta + used - (tonumber(s.cost) or used)
        c.used = c.used + used
    end
    if s.batch then count_in_batch(s.batch, status, prompt_tokens, completion_tokens) end
    -- '' : the result was staged and END renamed it (take_staged).
    if result_json ~= '' then redis.call('SET', K.result .. job_id, result_json, 'EX', ttl) end
    if #final_fields > 0 or inline ~= '' then
        if s.wake and is_inline(s.wake) then
            -- `inline`: the worker's JSON of the job's last entries, its final entry last, as
            -- `"<job id>":[...]`, written as it came; else (the reaper's) the final entry here.
            if inline == '' then
                local entry = {{}}
                for j = 1, #final_fields, 2 do entry[final_fields[j]] = final_fields[j + 1] end
                inline = cjson.encode(job_id) .. ':' .. cjson.encode({{entry}})
            end
            push(acc.inline, s.wake, inline)
        elseif #final_fields > 0 then
            local skey = K.stream .. job_id
            redis.call('XADD', skey, 'MAXLEN', '~', maxlen, '*', unpack(final_fields))
            -- stream_ttl '0': the stream's TTL was set with its first entry of this run.
            if stream_ttl ~= '0' then redis.call('EXPIRE', skey, stream_ttl) end
        end
        if s.wake then push(acc.wakes, s.wake, job_id) end
    end
    if s.notify then
        push(acc.ended_ids, s.notify, job_id)
        push(acc.ended_statuses, s.notify, status)
    end
end

-- Tells each producer (notify id) which of its jobs ended, with their statuses in the same
-- order: one entry per events stream and call, while the stream exists.
local function tell_events(ids, statuses)
    for notify, ended in pairs(ids) do
        redis.call('XADD', K.events .. notify, 'NOMKSTREAM', 'MAXLEN', '~', {EVENTS_MAXLEN}, '*',
            'jobs', table.concat(ended, ' '), 'statuses', table.concat(statuses[notify], ' '))
    end
end

-- worker_key '' for the reaper: the worker is dead, no counters. `minid`, `ttl`: tell_wakes'.
local function flush(acc, worker_key, minid, ttl)
    for key, members in pairs(acc.zrem) do redis.call('ZREM', key, unpack(members)) end
    for key, args in pairs(acc.zadd) do redis.call('ZADD', key, unpack(args)) end
    if worker_key ~= '' then
        for field, n in pairs(acc.counters) do redis.call('HINCRBY', worker_key, field, n) end
    end
    for _, c in pairs(acc.charges) do pq_charge(c.root, c.tenant, c.delta, c.used) end
    tell_wakes(acc.wakes, acc.inline, minid, ttl)
    tell_events(acc.ended_ids, acc.ended_statuses)
end
"""

# One job's ending in END's and REQUEUE's ARGV: these fields, then `n_rq` field/values of RQ's
# result entry, then `n_final` of the final stream entry. `result` is the GenerationResult
# JSON ('' when the worker staged it: take_staged), `prompt_tokens`, `completion_tokens` its
# usage (what the tenant is charged and the batch counts), so the script never parses the
# result. `inline`, for a job of an inline hub: its entries not written yet and its final
# entry, as `"<job id>":[...]` of the hub's JSON object (producer/contract/stream.py), so that
# its last tokens need no STREAM call of their own; it then has no final fields.
ENDING_FIELDS = (
    "job_id",
    "queue",
    "execution",
    "status",
    "ended_at",
    "score",
    "ttl",
    "result",
    "prompt_tokens",
    "completion_tokens",
    "stream_ttl",
    "inline",
    "n_rq",
    "n_final",
)
_OFFSETS = ", ".join(f"{name} = {i}" for i, name in enumerate(ENDING_FIELDS))
_ENDING_CONSTRUCTOR = ", ".join(f"{name} = ARGV[i + {i}]" for i, name in enumerate(ENDING_FIELDS))
ENDING_LUA = f"""
local E = {{{_OFFSETS}}}
local E_LEN = {len(ENDING_FIELDS)}

-- The ending at ARGV[i]: its fields, and the index of the next one.
local function ending_at(i)
    local n_rq, n_final = tonumber(ARGV[i + E.n_rq]), tonumber(ARGV[i + E.n_final])
    -- One constructor: the table is sized once, not grown field by field.
    local e = {{{_ENDING_CONSTRUCTOR},
        rq_fields = slice(ARGV, i + E_LEN, n_rq),
        final_fields = slice(ARGV, i + E_LEN + n_rq, n_final)}}
    return e, i + E_LEN + n_rq + n_final
end

-- An ending whose `result` is '' had its result written ahead by its worker, beside this call
-- (staged_result_key, with the result's TTL): renamed to the result key, so that the JSON never
-- enters Lua. False when it is gone (evicted): the job is then not ended.
local function take_staged(e)
    local r = redis.pcall('RENAME', K.staged .. e.job_id .. ':' .. e.execution,
        K.result .. e.job_id)
    return not (type(r) == 'table' and r.err)
end

-- A staged result whose job this call does not end (lease lost, or a repeated call).
local function drop_staged(e)
    if e.result == '' then redis.call('DEL', K.staged .. e.job_id .. ':' .. e.execution) end
end

local function end_with(acc, s, e, status, maxlen)
    end_job(acc, s, e.job_id, e.queue, e.job_id .. ':' .. e.execution, status, e.ended_at,
        e.score, e.ttl, e.result, tonumber(e.prompt_tokens), tonumber(e.completion_tokens),
        e.rq_fields, e.final_fields, e.stream_ttl, maxlen, e.inline)
end

-- Ends each held job of the endings from ARGV[i] to the last as its ending says (END's work,
-- written by the caller's `flush`). Per job 1 when ended, 2 when this execution had already
-- ended it so (a call repeated after a lost reply: nothing written again), 0 when this
-- execution no longer holds it, or its staged result is gone (nothing written for it).
local function end_all(acc, i, maxlen)
    local replies = {{}}
    while i <= #ARGV do
        local e, next_i = ending_at(i)
        local s = job_state(RQ.job .. e.job_id)
        if held_by(s, e.execution) and (e.result ~= '' or take_staged(e)) then
            end_with(acc, s, e, e.status, maxlen)
            replies[#replies + 1] = 1
        elseif s.execution == e.execution and s.status == e.status then
            -- This execution's own ending, sent again after its reply was lost (the first
            -- call ran while the connection was cut): ended once, and by this worker.
            drop_staged(e)
            replies[#replies + 1] = 2
        else
            drop_staged(e)
            replies[#replies + 1] = 0
        end
        i = next_i
    end
    return replies
end
"""
_ENDING_LIBS = (UTIL_LUA, CHARGE_LUA, END_LUA, ENDING_LUA)

# KEYS after the named ones: the base queue keys the worker serves (its model's, the generic).
# Picks up to `max_jobs` jobs (none whose aged priority is above `max_priority`, unless '')
# across the sub-queues of those bases, then up to `ahead` more while the next pick is a bulk
# job (read from an events stream or a batch's counts) and at least `ahead` jobs would stay
# queued for other workers (the worker's --prefetch: fewer, larger calls from a deep queue),
# pops them and marks each started under a lease
# (execution id `execution` .. its number in hex), in one step: a worker killed at any instant
# leaves each job either queued or visible in the started registry.
# Returns per job {queue, job_id, execution, attempt, data, enqueued_at, timeout, canceled,
# prior status, plain (1: enqueued by a plain RQ producer)}; empty when nothing is queued.
DEQUEUE = LuaScript(
    "dequeue",
    args=(
        "lease_deadline",
        "worker_name",
        "execution",
        "started_at",
        "max_jobs",
        "ahead",
        "max_pops",
        "aging_s",
        "max_wait_s",
        "max_priority",
    ),
    libraries=(UTIL_LUA, PICK_LUA),
    body="""
local limit = tonumber(a_max_priority)
local bases = {}
for i = KEYS_REST, #KEYS do bases[#bases + 1] = string.sub(KEYS[i], string.len(RQ.queue) + 1) end
local max_jobs, ahead = tonumber(a_max_jobs), tonumber(a_ahead)
local aging_s, max_wait_s = tonumber(a_aging_s), tonumber(a_max_wait_s)
-- Reading 2 x `ahead` ids more tells whether `ahead` would stay queued after the extra ones.
local P = pq_picker(bases, max_jobs + 2 * ahead, tonumber(a_max_pops))
-- Leases are on the workers' clock, as the heartbeat and the reaper keep them; the worker
-- prints the deadline (Lua would parse and print a float of 17 digits: ~8,000 instructions).
local deadline = a_lease_deadline
local taken, wip, cancels = {}, {}, {}
for n = 1, max_jobs + ahead do
    local extra = n > max_jobs
    if extra and pq_left(P) <= ahead then break end
    local picked = pq_pick(P, aging_s, max_wait_s, limit, extra)
    if not picked then break end
    local f, id = picked.f, picked.id
    local execution = a_execution .. string.format('%x', n)
    local attempt = (tonumber(f[7]) or 0) + 1
    redis.call('HSET', RQ.job .. id, 'status', 'started', 'started_at', a_started_at,
        'last_heartbeat', a_started_at, 'worker_name', a_worker_name, F.execution, execution,
        F.attempts, string.format('%d', attempt), F.base, picked.base, F.tenant, picked.tenant,
        F.cost, picked.cost_text)
    push(wip, RQ.wip .. picked.queue, deadline, id .. ':' .. execution)
    cancels[#cancels + 1] = K.cancel .. id
    taken[#taken + 1] = {picked.queue, id, execution, attempt, f[4] or '', f[5] or '',
        f[6] or '', 0, f[3] or '', f[1] and 0 or 1, pq_bulk(f) and 1 or 0, f[10] or ''}
end
pq_commit(P)
-- Jobs are left: ring their base's bell once more (when no ring waits there), so that another
-- waiting worker takes them; a producer rang once per BELL_JOBS jobs, and this worker may
-- have taken fewer.
if #taken > 0 then
    for base in pairs(pq_left_bases(P)) do
        if redis.call('LLEN', K.bell .. base) == 0 then ring_bell(base, 1) end
    end
end
for key, args in pairs(wip) do redis.call('ZADD', key, unpack(args)) end
if #cancels > 0 then
    local c = redis.call('MGET', unpack(cancels))
    for j = 1, #c do if c[j] then taken[j][8] = 1 end end
end
return taken
""",
)

# KEYS: the job hashes of the endings (one shard), then the worker's key when `counters` is 1.
# KEYS: the base queue keys of one shard, as DEQUEUE's. Returns {best aged priority of its
# queued jobs} (as text), or {} when none is queued: a sharded worker asks every shard, then
# dequeues from the best one up to the next best's priority (DEQUEUE's `max_priority`).
PEEK = LuaScript(
    "peek",
    args=("aging_s", "max_pops"),
    libraries=(UTIL_LUA, PICK_LUA),
    body="""
local bases = {}
for i = KEYS_REST, #KEYS do bases[#bases + 1] = string.sub(KEYS[i], string.len(RQ.queue) + 1) end
local best = pq_best(pq_picker(bases, 1, tonumber(a_max_pops)), tonumber(a_aging_s))
if best == nil then return {} end
return {tostring(best)}
""",
)

# ARGV after the named ones: endings (ENDING_FIELDS and their entries), one per job.
# Ends each held job as finished, failed or canceled (an ending whose `result` is '' renames
# the result its worker staged: take_staged). Returns per job 1 when ended, 2 when this
# execution had already ended it so (a call repeated after a lost reply: nothing written
# again), 0 when this execution no longer holds it, or its staged result is gone (nothing
# written for it).
END = LuaScript(
    "end",
    args=("maxlen", "counters", "wake_minid", "wake_ttl"),
    libraries=_ENDING_LIBS,
    body="""
local k_worker = a_counters == '1' and KEYS[#KEYS] or ''
local acc = new_acc()
local replies = end_all(acc, REST, a_maxlen)
flush(acc, k_worker, a_wake_minid, a_wake_ttl)
return replies
""",
)

# KEYS: the job's hash, then the worker's key when `counters` is 1.
# ARGV after the named ones: one ending (the failure written when the crash count reaches
# max_crashes). Puts a held job back at the front of its queue (a graceful stop, or an engine
# crash that counts against the job). Returns 1 requeued, 2 failed (too many crashes), 0 not
# held.
REQUEUE = LuaScript(
    "requeue",
    args=("count_crash", "max_crashes", "maxlen", "counters", "wake_minid", "wake_ttl"),
    libraries=_ENDING_LIBS,
    body="""
local k_worker = a_counters == '1' and KEYS[#KEYS] or ''
local e = ending_at(REST)
local jkey = RQ.job .. e.job_id
local s = job_state(jkey)
if not held_by(s, e.execution) then return 0 end
if a_count_crash == '1' then
    local crashes = redis.call('HINCRBY', jkey, F.crashes, 1)
    if crashes >= tonumber(a_max_crashes) then
        local acc = new_acc()
        end_with(acc, s, e, 'failed', a_maxlen)
        flush(acc, k_worker, a_wake_minid, a_wake_ttl)
        return 2
    end
end
redis.call('ZREM', RQ.wip .. e.queue, e.job_id .. ':' .. e.execution)
redis.call('HSET', jkey, 'status', 'queued')
redis.call('LPUSH', RQ.queue .. e.queue, e.job_id)
reindex(jkey, e.queue)
ring_bell(s.base or e.queue, 1)
return 1
""",
)

# The entries of a STREAM call, also the first part of a STEP call's. KEYS after the named ones:
# per queue of the entries (one shard), its started registry and this worker's lease fence there
# (`fence_key`). ARGV from `first` to `last`: per queue, its name and the fence's value the
# worker last saw; then `n_streams` jobs with streams of their own, each job_id, lease, wake
# ('' for none), set_ttl (0/1), n, n field/values; then per inline hub its wake id, the JSON
# object of its jobs' entries (producer/contract/stream.py), their ids joined by spaces (or '',
# for a hub of deltas: then the keys of that object, read only when a fence moved), and their
# leases joined the same way, in the same order. A job's lease is `<q>:<rest>`: the number of
# its queue among the call's, and the rest of its execution id after the worker's `prefix`.
# Appends one window's token entries, each only if its execution still holds the job. A lease
# is taken from a live worker only by another worker's reaper (REAP), which bumps the worker's
# fence in that queue: while the fence is what the worker last saw, every lease there holds and
# none is read; when it moved, each job's member is looked up in the queue's started registry
# (one ZMSCORE, as HEARTBEAT checks them). An inline hub gets its jobs' entries as the worker
# built them, in one wake entry, untouched while every lease holds (re-encoded without a job
# whose lease was lost): the script's work does not grow with the jobs, only with their bytes.
# The wake id comes from the caller, which read it with the job (DEQUEUE).
STREAM_LUA = """
-- The keys of the JSON object `text` in order: the job ids of a hub's entries as the worker
-- encoded them (encode_inline; it sends them apart, `ids`, when one would need unescaping).
local function json_keys(text)
    local keys, depth, i = {}, 0, 1
    while true do
        i = string.find(text, '[%[%]{}"]', i)
        if not i then return keys end
        local c = string.byte(text, i)
        if c == 34 then  -- a string, up to its first quote that no backslash escapes
            local j, escaped = i, false
            repeat
                j = string.find(text, '["' .. string.char(92) .. ']', j + 1)
                escaped = string.byte(text, j) == 92
                if escaped then j = j + 1 end
            until not escaped
            if depth == 1 then keys[#keys + 1] = string.sub(text, i + 1, j - 1) end
            i = j + 1
        else
            depth = depth + ((c == 123 or c == 91) and 1 or -1)
            i = i + 1
        end
    end
end

-- A hub's job ids in a call: `ids` (joined by spaces), or, when '', the keys of its entries.
local function hub_job_ids(data, ids)
    if ids == '' then return json_keys(data) end
    local out = {}
    for job_id in string.gmatch(ids, '%S+') do out[#out + 1] = job_id end
    return out
end

-- Writes the entries of ARGV[first .. last] (see above); the hubs' go to `wakes` and `inline`
-- for tell_wakes. Returns the job ids whose entries were refused (the lease was lost) and the
-- (queue, fence) pairs of the fences that moved.
local function write_entries(wakes, inline, first, last, n_queues, n_streams, maxlen,
                             stream_ttl, prefix)
    local moved, fences = nil, {}
    for q = 1, n_queues do
        local fence = redis.call('GET', KEYS[KEYS_REST + 2 * q - 1]) or ''
        if fence ~= ARGV[first + 2 * q - 1] then
            moved = moved or {}
            moved[q] = {members = {}, ids = {}}
            fences[#fences + 1] = ARGV[first + 2 * q - 2]
            fences[#fences + 1] = fence
        end
    end
    first = first + 2 * n_queues
    local gone = {}
    if moved then
        -- A fence moved: look up the lease of each of the call's jobs in that queue.
        local function note(job_id, lease)
            local q, rest = string.match(lease, '^(%d+):(.*)$')
            local m = moved[tonumber(q)]
            if m then
                m.members[#m.members + 1] = job_id .. ':' .. prefix .. rest
                m.ids[#m.ids + 1] = job_id
            end
        end
        local i = first
        for _ = 1, n_streams do
            note(ARGV[i], ARGV[i + 1])
            i = i + 5 + tonumber(ARGV[i + 4])
        end
        while i <= last do
            local leases = string.gmatch(ARGV[i + 3], '%S+')
            for _, job_id in ipairs(hub_job_ids(ARGV[i + 1], ARGV[i + 2])) do
                note(job_id, leases())
            end
            i = i + 4
        end
        for q, m in pairs(moved) do
            if #m.members > 0 then
                local scores = redis.call('ZMSCORE', KEYS[KEYS_REST + 2 * q - 2],
                    unpack(m.members))
                for k, job_id in ipairs(m.ids) do
                    if not scores[k] then gone[job_id] = true end
                end
            end
        end
    end
    local lost = {}
    local i = first
    for _ = 1, n_streams do
        local job_id, wake, n = ARGV[i], ARGV[i + 2], tonumber(ARGV[i + 4])
        if gone[job_id] then
            lost[#lost + 1] = job_id
        else
            local skey = K.stream .. job_id
            redis.call('XADD', skey, 'MAXLEN', '~', maxlen, '*', unpack(ARGV, i + 5, i + 4 + n))
            if ARGV[i + 3] == '1' then redis.call('EXPIRE', skey, stream_ttl) end
            if wake ~= '' then push(wakes, wake, job_id) end
        end
        i = i + 5 + n
    end
    while i <= last do
        local wake, data, ids = ARGV[i], ARGV[i + 1], ARGV[i + 2]
        i = i + 4
        if moved then
            local kept, dropped = {}, {}
            for _, job_id in ipairs(hub_job_ids(data, ids)) do
                local into = gone[job_id] and dropped or kept
                into[#into + 1] = job_id
            end
            if #dropped > 0 then
                local by_job = cjson.decode(data)
                for _, job_id in ipairs(dropped) do
                    by_job[job_id] = nil
                    lost[#lost + 1] = job_id
                end
                data, ids = cjson.encode(by_job), kept
            end
        end
        if type(ids) == 'string' or #ids > 0 then
            wakes[wake] = ids
            inline[wake] = data
        end
    end
    return lost, fences
end
"""

# Appends one window's token entries (STREAM_LUA): KEYS and ARGV after the named ones as there.
# Returns {the job ids whose entries were refused (the lease was lost), (queue, fence) pairs of
# the fences that moved}, or 0 for neither.
STREAM = LuaScript(
    "stream",
    args=("maxlen", "stream_ttl", "prefix", "n_queues", "n_streams", "wake_minid", "wake_ttl"),
    libraries=(UTIL_LUA, CHARGE_LUA, END_LUA, STREAM_LUA),
    body="""
local wakes, inline = {}, {}
local lost, fences = write_entries(wakes, inline, REST, #ARGV, tonumber(a_n_queues),
    tonumber(a_n_streams), a_maxlen, a_stream_ttl, a_prefix)
tell_wakes(wakes, inline, a_wake_minid, a_wake_ttl)
-- The common reply, an integer: a table costs the conversion of each of its levels.
if #lost == 0 and #fences == 0 then return 0 end
return {lost, fences}
""",
)

# A step's STREAM and END calls of one shard in one: KEYS, STREAM's then END's (the job hashes,
# then the worker's key when `counters` is 1); ARGV after the named ones, STREAM's
# (`stream_args` values) then END's endings. The entries are written first, so that a job's
# final entry follows its last tokens; a hub gets a wake entry for each part. Returns
# {STREAM's reply, END's}.
STEP = LuaScript(
    "step",
    # STREAM's named arguments first: RQAdapter.step_call takes them from a STREAM call.
    args=(*STREAM.args, "counters", "stream_args"),
    libraries=(*_ENDING_LIBS, STREAM_LUA),
    body="""
local k_worker = a_counters == '1' and KEYS[#KEYS] or ''
local wakes, inline = {}, {}
local last = REST + tonumber(a_stream_args) - 1
local lost, fences = write_entries(wakes, inline, REST, last, tonumber(a_n_queues),
    tonumber(a_n_streams), a_maxlen, a_stream_ttl, a_prefix)
-- The window's entries as STREAM writes them (a hub's JSON object untouched: joining the
-- endings' members to it would copy and hash it again), then the endings'.
tell_wakes(wakes, inline, a_wake_minid, a_wake_ttl)
local acc = new_acc()
local replies = end_all(acc, last + 1, a_maxlen)
flush(acc, k_worker, a_wake_minid, a_wake_ttl)
if #lost == 0 and #fences == 0 then return {0, replies} end
return {{lost, fences}, replies}
""",
)

# KEYS: the started registries of the held executions (one shard), then the worker's key when
# `counters` is 1. ARGV after the named ones: (queue, member) pairs of every held execution.
# Renews every lease still in its started registry (one ZMSCORE and one ZADD XX per queue) and,
# with the worker's key, its registration. Returns the members whose lease was lost (the entry
# is gone).
HEARTBEAT = LuaScript(
    "heartbeat",
    args=("lease_deadline", "worker_ttl", "now", "last_heartbeat", "state", "counters"),
    libraries=(UTIL_LUA,),
    body="""
local lost, by_queue = {}, {}
for i = REST, #ARGV, 2 do push(by_queue, ARGV[i], ARGV[i + 1]) end
local held = held_leases(by_queue)
for queue, members in pairs(by_queue) do
    local renew = {}
    for _, member in ipairs(members) do
        if held[member] then
            renew[#renew + 1] = a_lease_deadline
            renew[#renew + 1] = member
        else
            lost[#lost + 1] = member
        end
    end
    if #renew > 0 then redis.call('ZADD', RQ.wip .. queue, 'XX', unpack(renew)) end
end
if a_counters == '1' then
    local k_worker = KEYS[#KEYS]
    redis.call('HSET', k_worker, 'last_heartbeat', a_last_heartbeat, 'pagedq_heartbeat', a_now,
        'state', a_state)
    redis.call('EXPIRE', k_worker, a_worker_ttl)
end
return lost
""",
)

# KEYS after the named ones: the started registries (RQ.wip .. queue) of the worker's queues
# of one shard.
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
        "wake_minid",
        "wake_ttl",
    ),
    libraries=(UTIL_LUA, CHARGE_LUA, END_LUA),
    body="""
local now, max_crashes = tonumber(a_now), tonumber(a_max_crashes)
local requeued, failed = {}, {}
local acc = new_acc()
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
        local ended = false
        if sep and mine then
            local s = job_state(jkey)
            if held_by(s, execution) then
                bump_fence(queue, execution)
                local crashes = redis.call('HINCRBY', jkey, F.crashes, 1)
                if crashes >= max_crashes then
                    local result = cjson.encode({job_id = job_id, status = 'failed',
                        error = a_reason})
                    end_job(acc, s, job_id, queue, member, 'failed', a_ended_at,
                        now + tonumber(a_failure_ttl), a_failure_ttl, result, 0, 0,
                        {'type', RESULT.failed, 'worker_name', '', 'exc_string', a_exc_string},
                        {'event', 'error', 'error', a_reason}, a_stream_ttl, a_maxlen, '')
                    failed[#failed + 1] = job_id
                    ended = true
                else
                    redis.call('HSET', jkey, 'status', 'queued')
                    redis.call('LPUSH', RQ.queue .. queue, job_id)
                    reindex(jkey, queue)
                    ring_bell(s.base or queue, 1)
                    requeued[#requeued + 1] = job_id
                end
            end
        end
        -- An ended job's entry leaves with the call's other registry moves.
        if mine and not ended then redis.call('ZREM', wip, member) end
    end
    for _, registry in ipairs({'finished', 'failed', 'canceled'}) do
        redis.call('ZREMRANGEBYSCORE', RQ[registry] .. queue, '-inf', now)
    end
end
flush(acc, '', a_wake_minid, a_wake_ttl)
return {requeued, failed}
""",
)

# ARGV after the named ones: `n_fields` field/values of the worker hash. Writes the worker hash
# like RQ's register_birth, but takes over a registration under the same name whose heartbeat
# is older than a lease (its process died). Returns 1, or 0 if it is live. RQ's sets of workers
# and queues are other slots: the caller adds to them after (RQAdapter.register_calls).
REGISTER = LuaScript(
    "register",
    keys=("worker",),
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
return 1
""",
)

SCRIPTS = (DEQUEUE, PEEK, END, REQUEUE, STREAM, STEP, HEARTBEAT, REAP, REGISTER)
