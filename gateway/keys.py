"""The Redis keys of the gateway's files and batches, from the wire contract.

| key | type | holds |
|---|---|---|
| `file_key(id)` | hash | a file's fields, owner, lines per chunk (an output: its batch) |
| `file_data_key(id)` | list | an uploaded file's bytes in chunks of whole lines (<= 1 MiB) |
| `files_index_key(owner)` | zset | the owner's file ids by creation time (us) |
| `batch_key(id)` | hash | a batch's fields and progress (next chunk to enqueue) |
| `batch_counts_key(id)` | hash | line ends, counted by the job-ending scripts |
| `batch_lease_key(id)` | string | the gateway working on it (expires: another takes over) |
| `batches_index_key(owner)` | zset | the owner's batch ids by creation time (us) |
| `ACTIVE_BATCHES` | set | batches still needing work (validating to finalizing) |
| `response_key(id)` | string | a stored Responses object and its conversation (JSON, TTL) |

The names themselves live in producer/contract/keys.py. On a Redis Cluster a batch's own keys
are built from `batch_ref(redis, id)`, its id as a hash tag, so that its hash and counts share
the slot the batch runner's COMMIT_CHUNK script needs; a sharded queue's jobs count their ends
in a counts hash of their own shard's slot (`shard_counts_keys`), summed with the batch's.
"""

from __future__ import annotations

from typing import Any

from producer.connection import is_cluster
from producer.contract.keys import (
    ACTIVE_BATCHES,
    batch_counts_key,
    batch_key,
    batch_lease_key,
    batches_index_key,
    file_data_key,
    file_key,
    files_index_key,
    response_key,
)
from producer.contract.shards import QueueShards, hash_tag, shard_name


def batch_ref(connection: Any, batch_id: str) -> str:
    """What a batch's own keys are built from: its id, or on a cluster ``{id}`` (one slot)."""
    return "{" + batch_id + "}" if is_cluster(connection) else batch_id


def shard_counts_keys(shards: QueueShards, batch_id: str) -> list[str]:
    """The counts hashes the ending scripts of a sharded queue's jobs write (none unsharded:
    theirs is the batch's own)."""
    if not shards.sharded:
        return []
    return [batch_counts_key(shard_name(hash_tag(name), batch_id)) for name in shards.names]


__all__ = [
    "batch_ref",
    "shard_counts_keys",
    "ACTIVE_BATCHES",
    "batch_counts_key",
    "batch_key",
    "batch_lease_key",
    "batches_index_key",
    "file_data_key",
    "file_key",
    "files_index_key",
    "response_key",
]
