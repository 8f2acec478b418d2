"""The Lua scripts through which a worker changes RQ's state: each one step, atomic in Redis.

They write what RQ's tooling reads (job hash, registries, result stream, worker registration)
and nothing else: no callback, dependency or webhook of RQ is ever looked at. Every script that
ends or streams a job is fenced: it first checks that the job is still `started` under the
caller's execution id (`pagedq_execution` in the job hash), and writes nothing otherwise.
Key names are built here from RQ 3.0's layout (prefix `rq:`); see docs/PROTOCOL.md.
"""

from __future__ import annotations

from worker.fair_queue import CHARGE_LUA, PICK_LUA

# Shared by the scripts below: `held` is the fence, `end_job` the one way a job ends.
PRELUDE = (
    CHARGE_LUA
    + """
local function held(jkey, execution)
    local f = redis.call('HMGET', jkey, 'status', 'pagedq_execution')
    return f[1] == 'started' and f[2] == execution
end

-- Puts a requeued job's sub-queue back in its base's index (the fair pick drops empty ones).
local function reindex(jkey, queue)
    local f = redis.call('HMGET', jkey, 'pq_base', 'pq_meta')
    if f[1] and f[2] and f[1] ~= queue then
        redis.call('HSET', 'pagedq:subqueues:' .. f[1], queue, f[2])
    end
end

-- Charges a job's tenant the tokens it used instead of the cost estimated when it was picked.
local function charge(jkey, result_json)
    local f = redis.call('HMGET', jkey, 'pq_base', 'pq_tenant', 'pq_cost')
    if not f[1] then return end
    local ok, result = pcall(cjson.decode, result_json)
    local usage = ok and type(result) == 'table' and result.usage
    local used = 0
    if type(usage) == 'table' then
        used = (tonumber(usage.prompt_tokens) or 0) + (tonumber(usage.completion_tokens) or 0)
    end
    pq_charge(f[1], f[2] or '', tonumber(f[3]) or used, used)
end

-- Counts a batch line's end in its batch's counts hash (producer.keys.batch_counts_key), only
-- while that hash exists: finished / failed / canceled, and the tokens of a finished one.
local function count_in_batch(jkey, status, result_json)
    local batch = redis.call('HGET', jkey, 'pq_batch')
    if not batch then return end
    local ckey = 'pagedq:batch:' .. batch .. ':counts'
    if redis.call('EXISTS', ckey) == 0 then return end
    redis.call('HINCRBY', ckey, status, 1)
    local ok, result = pcall(cjson.decode, result_json)
    local usage = ok and type(result) == 'table' and result.usage
    if status == 'finished' and type(usage) == 'table' then
        for _, field in ipairs({'prompt_tokens', 'completion_tokens'}) do
            local n = math.floor(tonumber(usage[field]) or 0)
            redis.call('HINCRBY', ckey, field, string.format('%d', n))
        end
    end
end

-- Ends a started job: RQ status, registries, RQ result entry, pagedq result key, final entry,
-- and the ending worker's RQ counters (worker_key '' for the reaper: the worker is dead).
local function end_job(job_id, queue, member, status, registry, ended_at, score, ttl,
                       result_json, rq_fields, final_fields, stream_ttl, maxlen, worker_key)
    local jkey = 'rq:job:' .. job_id
    local counter = ({finished = 'successful_job_count', failed = 'failed_job_count'})[status]
    if worker_key ~= '' and counter then redis.call('HINCRBY', worker_key, counter, 1) end
    redis.call('ZREM', 'rq:wip:' .. queue, member)
    redis.call('HSET', jkey, 'status', status, 'ended_at', ended_at)
    redis.call('EXPIRE', jkey, ttl)
    redis.call('ZADD', 'rq:' .. registry .. ':' .. queue, score, job_id)
    if #rq_fields > 0 then
        local rkey = 'rq:results:' .. job_id
        redis.call('XADD', rkey, 'MAXLEN', '10', '*', unpack(rq_fields))
        redis.call('EXPIRE', rkey, ttl)
    end
    charge(jkey, result_json)
    count_in_batch(jkey, status, result_json)
    redis.call('SET', 'pagedq:result:' .. job_id, result_json, 'EX', ttl)
    local skey = 'pagedq:stream:' .. job_id
    redis.call('XADD', skey, 'MAXLEN', '~', maxlen, '*', unpack(final_fields))
    -- stream_ttl '0': the stream's TTL was set with its first entry of this run.
    if stream_ttl ~= '0' then redis.call('EXPIRE', skey, stream_ttl) end
end

local function slice(t, first, count)
    local out = {}
    for i = first, first + count - 1 do out[#out + 1] = t[i] end
    return out
end
"""
)

# KEYS: the base queue keys (rq:queue:NAME) the worker serves (its model's queue, the generic one).
# ARGV: now, lease_ttl, worker_name, execution, started_at (RQ's date format), max_pops,
#       aging_seconds, max_wait_seconds.
# Picks the next job across the sub-queues of those bases (priority with aging, then tenant
# fairness: worker/fair_queue.py), pops it and marks it started under a lease, in one step: a
# worker killed at any instant leaves the job either queued or visible in the started registry.
# Returns {queue, job_id, attempt, data, enqueued_at, timeout, canceled, prior status} or false.
DEQUEUE = (
    PICK_LUA
    + """
local now, lease = tonumber(ARGV[1]), tonumber(ARGV[2])
local bases = {}
for _, qkey in ipairs(KEYS) do bases[#bases + 1] = string.sub(qkey, string.len('rq:queue:') + 1) end
for _ = 1, tonumber(ARGV[6]) do
    local picked = pq_pick(bases, tonumber(ARGV[7]), tonumber(ARGV[8]))
    if not picked then break end
    local queue, job_id = picked[1], picked[2]
    local jkey = 'rq:job:' .. job_id
    local f = redis.call('HMGET', jkey, 'status', 'data', 'enqueued_at', 'timeout',
        'pagedq_attempts')
    -- A hash without status but with data is started too, so that it fails with a reason.
    if f[1] == 'queued' or (not f[1] and f[2]) then
        local attempt = (tonumber(f[5]) or 0) + 1
        redis.call('HSET', jkey, 'status', 'started', 'started_at', ARGV[5],
            'last_heartbeat', ARGV[5], 'worker_name', ARGV[3], 'pagedq_execution', ARGV[4],
            'pagedq_attempts', attempt, 'pq_base', picked[3], 'pq_tenant', picked[4],
            'pq_cost', picked[5])
        redis.call('ZADD', 'rq:wip:' .. queue, now + lease, job_id .. ':' .. ARGV[4])
        local canceled = redis.call('EXISTS', 'pagedq:cancel:' .. job_id)
        return {queue, job_id, attempt, f[2] or '', f[3] or '', f[4] or '', canceled,
            f[1] or ''}
    end
    -- Anything else is a stale entry (job gone, canceled, or already run): dropped.
end
return false
"""
)

# KEYS[1]: the worker's RQ hash (its job counters).
# ARGV: job_id, queue, execution, status, registry, ended_at, score, ttl, result_json,
#       stream_ttl, maxlen, n_rq, n_final, rq field/value pairs..., final field/value pairs...
# Returns 1 when the job was ended, 0 when this execution no longer holds it (nothing written).
END = (
    PRELUDE
    + """
local job_id, queue, execution = ARGV[1], ARGV[2], ARGV[3]
if not held('rq:job:' .. job_id, execution) then return 0 end
local n_rq, n_final = tonumber(ARGV[12]), tonumber(ARGV[13])
end_job(job_id, queue, job_id .. ':' .. execution, ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8],
    ARGV[9], slice(ARGV, 14, n_rq), slice(ARGV, 14 + n_rq, n_final), ARGV[10], ARGV[11],
    KEYS[1])
return 1
"""
)

# KEYS[1]: the worker's RQ hash.
# ARGV: job_id, queue, execution, count_crash (0/1), max_crashes, then END's ARGV[4..] for the
# failure written when the crash count reaches max_crashes.
# Puts a held job back at the front of its queue (a graceful stop, or an engine crash that
# counts against the job). Returns 1 requeued, 2 failed (too many crashes), 0 not held.
REQUEUE = (
    PRELUDE
    + """
local job_id, queue, execution = ARGV[1], ARGV[2], ARGV[3]
local jkey = 'rq:job:' .. job_id
if not held(jkey, execution) then return 0 end
if ARGV[4] == '1' then
    local crashes = redis.call('HINCRBY', jkey, 'pagedq_crashes', 1)
    if crashes >= tonumber(ARGV[5]) then
        local n_rq, n_final = tonumber(ARGV[14]), tonumber(ARGV[15])
        end_job(job_id, queue, job_id .. ':' .. execution, 'failed', 'failed', ARGV[8], ARGV[9],
            ARGV[10], ARGV[11], slice(ARGV, 16, n_rq), slice(ARGV, 16 + n_rq, n_final),
            ARGV[12], ARGV[13], KEYS[1])
        return 2
    end
end
redis.call('ZREM', 'rq:wip:' .. queue, job_id .. ':' .. execution)
redis.call('HSET', jkey, 'status', 'queued')
redis.call('LPUSH', 'rq:queue:' .. queue, job_id)
reindex(jkey, queue)
return 1
"""
)

# ARGV: maxlen, stream_ttl, then per job: job_id, execution, set_ttl (0/1), n, n field/values.
# Appends one step's token entries, each only if its execution still holds the job.
# Returns the job ids whose entries were refused (the lease was lost).
STREAM = (
    PRELUDE
    + """
local maxlen, ttl = ARGV[1], ARGV[2]
local lost = {}
local i = 3
while i <= #ARGV do
    local job_id, execution, set_ttl, n = ARGV[i], ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3])
    if held('rq:job:' .. job_id, execution) then
        local skey = 'pagedq:stream:' .. job_id
        redis.call('XADD', skey, 'MAXLEN', '~', maxlen, '*', unpack(slice(ARGV, i + 4, n)))
        if set_ttl == '1' then redis.call('EXPIRE', skey, ttl) end
    else
        lost[#lost + 1] = job_id
    end
    i = i + 4 + n
end
return lost
"""
)

# KEYS[1]: the worker's RQ hash; KEYS[2]: the pagedq status key.
# ARGV: lease_deadline, worker_ttl, now, last_heartbeat (RQ format), state, status_json,
#       status_ttl, then (queue, member) pairs of every held execution.
# Renews every lease (ZADD XX CH: 0 means the entry is gone, the lease was lost) and the
# worker's registration. Returns the members whose lease was lost.
HEARTBEAT = """
local lost = {}
for i = 8, #ARGV, 2 do
    if redis.call('ZADD', 'rq:wip:' .. ARGV[i], 'XX', 'CH', ARGV[1], ARGV[i + 1]) == 0 then
        lost[#lost + 1] = ARGV[i + 1]
    end
end
redis.call('HSET', KEYS[1], 'last_heartbeat', ARGV[4], 'pagedq_heartbeat', ARGV[3],
    'state', ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[6], 'EX', ARGV[7])
return lost
"""

# KEYS: the started registries (rq:wip:NAME) of the worker's queues.
# ARGV: now, max_crashes, ended_at, failure_ttl, exc_string (RQ's b64 zlib form), reason,
#       stream_ttl, maxlen, limit.
# Our replacement for RQ's StartedJobRegistry.cleanup: an expired lease means the worker
# holding it died; its job goes back to the queue front, or fails once it was in flight
# during max_crashes crashes. Also drops expired finished/failed/canceled registry entries.
# Returns {requeued job ids, failed job ids}.
REAP = (
    PRELUDE
    + """
local now, max_crashes = tonumber(ARGV[1]), tonumber(ARGV[2])
local requeued, failed = {}, {}
for _, wip in ipairs(KEYS) do
    local queue = string.sub(wip, string.len('rq:wip:') + 1)
    local expired = redis.call('ZRANGEBYSCORE', wip, '-inf', now, 'LIMIT', 0, tonumber(ARGV[9]))
    for _, member in ipairs(expired) do
        local sep = string.find(member, ':[^:]*$')
        if sep then
            local job_id, execution = string.sub(member, 1, sep - 1), string.sub(member, sep + 1)
            local jkey = 'rq:job:' .. job_id
            if held(jkey, execution) then
                local crashes = redis.call('HINCRBY', jkey, 'pagedq_crashes', 1)
                if crashes >= max_crashes then
                    local result = cjson.encode({job_id = job_id, status = 'failed',
                        error = ARGV[6]})
                    end_job(job_id, queue, member, 'failed', 'failed', ARGV[3],
                        now + tonumber(ARGV[4]), ARGV[4], result,
                        {'type', '2', 'worker_name', '', 'exc_string', ARGV[5]},
                        {'event', 'error', 'error', ARGV[6]}, ARGV[7], ARGV[8], '')
                    failed[#failed + 1] = job_id
                else
                    redis.call('HSET', jkey, 'status', 'queued')
                    redis.call('LPUSH', 'rq:queue:' .. queue, job_id)
                    reindex(jkey, queue)
                    requeued[#requeued + 1] = job_id
                end
            end
        end
        redis.call('ZREM', wip, member)
    end
    for _, registry in ipairs({'finished', 'failed', 'canceled'}) do
        redis.call('ZREMRANGEBYSCORE', 'rq:' .. registry .. ':' .. queue, '-inf', now)
    end
end
return {requeued, failed}
"""
)

# KEYS[1]: rq:worker:NAME, KEYS[2]: rq:workers, KEYS[3..]: rq:workers:QUEUE per queue.
# ARGV: now, lease_ttl, key_ttl, then the hash's field/value pairs, then (after a '--') the
# queue keys to add to rq:queues.
# Registers the worker like RQ's register_birth, but takes over a registration under the same
# name whose heartbeat is older than a lease (its process died). Returns 1, or 0 if it is live.
REGISTER = """
local now, lease = tonumber(ARGV[1]), tonumber(ARGV[2])
if redis.call('EXISTS', KEYS[1]) == 1 then
    local f = redis.call('HMGET', KEYS[1], 'death', 'pagedq_heartbeat')
    if not f[1] and (not f[2] or now - tonumber(f[2]) < lease) then return 0 end
end
redis.call('DEL', KEYS[1])
local fields, queues, i = {}, {}, 4
while i <= #ARGV and ARGV[i] ~= '--' do fields[#fields + 1] = ARGV[i]; i = i + 1 end
for j = i + 1, #ARGV do queues[#queues + 1] = ARGV[j] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('EXPIRE', KEYS[1], ARGV[3])
for k = 2, #KEYS do redis.call('SADD', KEYS[k], KEYS[1]) end
if #queues > 0 then redis.call('SADD', 'rq:queues', unpack(queues)) end
return 1
"""

SCRIPTS = {
    "dequeue": DEQUEUE,
    "end": END,
    "requeue": REQUEUE,
    "stream": STREAM,
    "heartbeat": HEARTBEAT,
    "reap": REAP,
    "register": REGISTER,
}
