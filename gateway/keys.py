"""The Redis keys the gateway adds (files and batches); every other name comes from producer/.

| key | type | holds |
|---|---|---|
| `pagedq:file:{id}` | hash | a file's fields, owner, lines per chunk (an output: its batch) |
| `pagedq:file:{id}:data` | list | an uploaded file's bytes in chunks of whole lines (<= 1 MiB) |
| `pagedq:files:{owner}` | zset | the owner's file ids by creation time (us) |
| `pagedq:batch:{id}` | hash | a batch's fields and progress (next chunk to enqueue) |
| `pagedq:batch:{id}:counts` | hash | line ends, counted by the job-ending scripts |
| `pagedq:batch:{id}:lease` | string | the gateway working on it (expires: another takes over) |
| `pagedq:batches:{owner}` | zset | the owner's batch ids by creation time (us) |
| `pagedq:batches:active` | set | batches still needing work (validating to finalizing) |
"""

from __future__ import annotations

from producer.keys import KEY_PREFIX, batch_counts_key

__all__ = [
    "ACTIVE_BATCHES",
    "batch_counts_key",
    "batch_key",
    "batch_lease_key",
    "batches_index_key",
    "file_data_key",
    "file_key",
    "files_index_key",
]

ACTIVE_BATCHES = f"{KEY_PREFIX}:batches:active"


def file_key(file_id: str) -> str:
    """Hash of a file's fields."""
    return f"{KEY_PREFIX}:file:{file_id}"


def file_data_key(file_id: str) -> str:
    """List of an uploaded file's chunks."""
    return f"{KEY_PREFIX}:file:{file_id}:data"


def files_index_key(owner: str) -> str:
    """Sorted set of an owner's file ids, scored by creation time (microseconds)."""
    return f"{KEY_PREFIX}:files:{owner}"


def batch_key(batch_id: str) -> str:
    """Hash of a batch's fields."""
    return f"{KEY_PREFIX}:batch:{batch_id}"


def batch_lease_key(batch_id: str) -> str:
    """The lease of the gateway working on a batch."""
    return f"{KEY_PREFIX}:batch:{batch_id}:lease"


def batches_index_key(owner: str) -> str:
    """Sorted set of an owner's batch ids, scored by creation time (microseconds)."""
    return f"{KEY_PREFIX}:batches:{owner}"
