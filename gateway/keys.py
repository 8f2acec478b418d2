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

The names themselves live in producer/contract/keys.py.
"""

from __future__ import annotations

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

__all__ = [
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
