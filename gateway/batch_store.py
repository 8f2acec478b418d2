"""Batches in Redis: their records, OpenAI's Batch object, and guarded status changes."""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from redis import Redis

from gateway.config import Tenant
from gateway.errors import APIError, not_found
from gateway.file_store import FileStore
from gateway.keys import (
    ACTIVE_BATCHES,
    batch_counts_key,
    batch_key,
    batch_ref,
    batches_index_key,
    file_key,
    shard_counts_keys,
)
from producer.connection import is_cluster
from producer.contract.shards import QueueShards
from producer.openai_endpoints import OTHER_URLS
from producer.openai_output import CHAT_URL, COMPLETIONS_URL

ENDPOINTS = (CHAT_URL, COMPLETIONS_URL, *OTHER_URLS)
# OpenAI takes "24h" only; shorter windows ("90s", "30m", "2h") are a pagedq extension.
WINDOW_RE = re.compile(r"^(\d{1,7})([smhd])$")
WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_METADATA_PAIRS = 16
TIMESTAMPS = (
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)
STATUSES = (
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
)
ENDED = ("failed", "completed", "expired", "cancelled")

# KEYS[1]: the batch hash. ARGV[1]: the statuses it may be in (comma separated), then field /
# value pairs to set. Returns 1 when set, 0 when the batch was in another status.
TRANSITION = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 0 end
local allowed = false
for s in string.gmatch(ARGV[1], '[^,]+') do if s == status then allowed = true end end
if not allowed then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
return 1
"""


def window_seconds(window: str) -> int:
    """Seconds of a completion_window ("24h"); APIError 400 for another form."""
    match = WINDOW_RE.match(window) if isinstance(window, str) else None
    if match is None or int(match.group(1)) == 0:
        raise APIError(
            400,
            f"completion_window must be '24h' (or a duration like '90s', '30m', '2h'), "
            f"got {window!r}",
            param="completion_window",
        )
    return int(match.group(1)) * WINDOW_UNITS[match.group(2)]


def _int(value: str | None) -> int | None:
    return int(float(value)) if value not in (None, "") else None


def request_counts(fields: dict[str, str], counts: dict[str, str]) -> dict[str, int]:
    """OpenAI's request_counts: finished lines are completed; failed, refused, canceled and
    expired lines (the error file's) are failed."""
    finished = int(counts.get("finished", 0))
    failed = int(counts.get("failed", 0)) + int(counts.get("canceled", 0))
    return {"total": int(fields.get("total") or 0), "completed": finished, "failed": failed}


def batch_object(fields: dict[str, str], counts: dict[str, str]) -> dict[str, Any]:
    """OpenAI's Batch object from a batch's hash and its counts."""
    errors = json.loads(fields.get("errors") or "null")
    prompt, completion = (
        int(counts.get("prompt_tokens", 0)),
        int(counts.get("completion_tokens", 0)),
    )
    out: dict[str, Any] = {
        "id": fields["id"],
        "object": "batch",
        "endpoint": fields["endpoint"],
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": fields["input_file_id"],
        "completion_window": fields["completion_window"],
        "status": fields["status"],
        "output_file_id": fields.get("output_file_id") or None,
        "error_file_id": fields.get("error_file_id") or None,
        "request_counts": request_counts(fields, counts),
        "metadata": json.loads(fields.get("metadata") or "null"),
        "model": fields.get("model") or None,
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        },
    }
    for name in TIMESTAMPS:
        out[name] = _int(fields.get(name))
    return out


def _decode(raw: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in raw.items()}


class BatchStore:
    """Creates, reads, lists and cancels batches (sync Redis); the runner does the rest."""

    def __init__(
        self, redis: Redis, files: FileStore, record_ttl: int, queue: str, queue_shards: int = 1
    ) -> None:
        self.redis = redis
        self.queue = queue
        self.shards = QueueShards(queue, queue_shards, tagged=is_cluster(redis))
        self.files = files
        self.record_ttl = record_ttl
        self._transition = redis.register_script(TRANSITION)

    def create(self, tenant: Tenant, body: dict[str, Any]) -> dict[str, Any]:
        """A new batch in `validating`; any gateway's runner then validates and enqueues it."""
        input_file_id = body.get("input_file_id")
        if not isinstance(input_file_id, str) or not input_file_id:
            raise APIError(400, "input_file_id is required", param="input_file_id")
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise APIError(
                400,
                f"endpoint must be one of {list(ENDPOINTS)}, got {endpoint!r}",
                param="endpoint",
            )
        window = body.get("completion_window")
        seconds = window_seconds(window)
        metadata = body.get("metadata")
        _check_metadata(metadata)
        file = self.files.fields(tenant.owner, input_file_id)
        if file.get("kind") != "upload" or file.get("purpose") != "batch":
            raise APIError(
                400,
                f"file {input_file_id} was not uploaded with purpose 'batch'",
                param="input_file_id",
            )
        batch_id = "batch_" + uuid.uuid4().hex[:24]
        now = int(time.time())
        fields = {
            "id": batch_id,
            "owner": tenant.owner,
            "queue": self.queue,
            "queue_shards": self.shards.count,
            "tenant": tenant.name or "",
            "priority": tenant.batch_priority,
            "status": "validating",
            "endpoint": endpoint,
            "input_file_id": input_file_id,
            "completion_window": window,
            "created_at": now,
            "expires_at": now + seconds,
            "metadata": json.dumps(metadata),
            "total": int(file.get("requests", 0)),
            "next_chunk": 0,
            "stop": "",
        }
        pipe = self.redis.pipeline()
        ref = batch_ref(self.redis, batch_id)
        pipe.hset(batch_key(ref), mapping=fields)
        pipe.expire(batch_key(ref), self.record_ttl)
        # The workers' end script counts only while this hash exists (each shard's, sharded).
        for counts in [batch_counts_key(ref), *shard_counts_keys(self.shards, batch_id)]:
            pipe.hset(counts, "created_at", now)
            pipe.expire(counts, self.record_ttl)
        pipe.zadd(batches_index_key(tenant.owner), {batch_id: time.time_ns() // 1000})
        # A file a batch reads is only hidden when deleted: its outputs are made from it.
        pipe.hincrby(file_key(input_file_id), "batch_refs", 1)
        pipe.sadd(ACTIVE_BATCHES, batch_id)
        pipe.execute()
        return self.get(tenant.owner, batch_id)

    def fields(self, batch_id: str) -> dict[str, str]:
        """A batch's hash ({} when absent)."""
        return _decode(self.redis.hgetall(batch_key(batch_ref(self.redis, batch_id))))

    def counts(self, batch_id: str) -> dict[str, str]:
        """A batch's counts hash (with its shards' counts added, sharded)."""
        counts = _decode(self.redis.hgetall(batch_counts_key(batch_ref(self.redis, batch_id))))
        shards = self.shards
        queue_shards = int(self.fields(batch_id).get("queue_shards") or 1) if shards.sharded else 1
        if queue_shards != shards.count:
            shards = QueueShards(self.queue, queue_shards, tagged=shards.tagged)
        for key in shard_counts_keys(shards, batch_id):
            for name, value in _decode(self.redis.hgetall(key)).items():
                if name != "created_at":
                    counts[name] = str(int(counts.get(name, 0)) + int(value))
        return counts

    def owned(self, owner: str, batch_id: str) -> dict[str, str]:
        """A batch's hash; 404 when absent or another owner's."""
        fields = self.fields(batch_id)
        if not fields or fields.get("owner") != owner:
            raise not_found("batch", batch_id)
        return fields

    def get(self, owner: str, batch_id: str) -> dict[str, Any]:
        """The Batch object."""
        fields = self.owned(owner, batch_id)
        return batch_object(fields, self.counts(batch_id))

    def list(self, owner: str, after: str | None, limit: int) -> dict[str, Any]:
        """A page of the owner's batches, newest first (OpenAI's order)."""
        ids = [i.decode() for i in self.redis.zrevrange(batches_index_key(owner), 0, -1)]
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        data, gone = [], []
        for batch_id in ids:
            fields = self.fields(batch_id)
            if not fields:
                gone.append(batch_id)
                continue
            data.append(batch_object(fields, self.counts(batch_id)))
            if len(data) > limit:
                break
        if gone:
            self.redis.zrem(batches_index_key(owner), *gone)
        page = data[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(data) > limit,
        }

    def cancel(self, owner: str, batch_id: str) -> dict[str, Any]:
        """Ask to cancel: `cancelling` now; the runner cancels the lines and ends it."""
        fields = self.owned(owner, batch_id)
        if fields["status"] not in ("cancelling", "cancelled"):
            now = int(time.time())
            changed = self.transition(
                batch_id,
                ("validating", "in_progress"),
                status="cancelling",
                cancelling_at=now,
                stop="cancelled",
            )
            if not changed:
                status = self.fields(batch_id).get("status")
                raise APIError(
                    409,
                    f"cannot cancel batch {batch_id}: its status is {status!r}",
                    code="batch_not_cancellable",
                )
            self.redis.sadd(ACTIVE_BATCHES, batch_id)
        return self.get(owner, batch_id)

    def transition(self, batch_id: str, allowed: tuple[str, ...], **fields: Any) -> bool:
        """Set `fields` only if the batch's status is one of `allowed` (atomic)."""
        pairs = [str(x) for kv in fields.items() for x in kv]
        keys = [batch_key(batch_ref(self.redis, batch_id))]
        return bool(self._transition(keys=keys, args=[",".join(allowed), *pairs]))


def _check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        raise APIError(
            400, "metadata must be an object of at most 16 key-value pairs", param="metadata"
        )
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise APIError(
                400,
                "metadata keys must be at most 64 characters and values strings of at most 512",
                param="metadata",
            )
