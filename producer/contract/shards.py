"""Queue shards and hash tags: which Redis Cluster slot each of a job's keys lives in.

A Redis Cluster runs a Lua script only when every key it touches hashes to one slot, and a
key's slot is the CRC16 of its hash tag (the text between its first ``{`` and the next ``}``)
when it has one. So pagedq gives each shard of a queue one tag and puts it in every name the
shard's keys are built from:

- the shard's queue name is ``{queue.i}`` (shard ``i`` of ``queue``), or ``{queue.i.k}`` with
  the first ``k`` that puts it in the ``i``-th of ``count`` equal ranges of slots: a cluster
  whose primaries hold equal ranges (what ``redis-cli --cluster create`` and managed services
  set up) gets one shard per primary when there are as many shards as primaries, and an even
  share of them with more. The model, priority and
  tenant sub-queues are built from it by suffixes (``{queue.i}@model:p5:t:acme``), and so are
  RQ's registries, the sub-queue index and the fair-queueing accounts (their root is the
  shard): all in the shard's slot;
- a job placed on the shard has the id ``{queue.i}`` + its plain id, so its job hash, result,
  token stream, cancel key and RQ result stream are in the slot too;
- a gateway batch's or a producer's per-shard names (`shard_name`) carry the tag as well, so
  the batch counts and events a job's end writes are in its slot.

On one Redis with one shard (the default) nothing is tagged: every name is what it always was,
and RQ's own tools read them. A producer picks a job's shard by its plain id (`place`), so the
same request under the same custom_id always lands on the same shard (idempotent re-enqueue).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache

from redis.crc import key_slot

MAX_SHARDS = 256
NUM_SLOTS = 16384


def hash_tag(name: str) -> str:
    """The hash tag of a key or name, braces included ('' when it has none), as Redis Cluster
    finds it: the first ``{``, then the next ``}`` with something between them."""
    start = name.find("{")
    if start < 0:
        return ""
    end = name.find("}", start + 1)
    if end <= start + 1:
        return ""
    return name[start : end + 1]


def slot_of(key: str | bytes) -> int:
    """The cluster slot of a key (0-16383), by its hash tag when it has one."""
    return key_slot(key.encode() if isinstance(key, str) else key)


@lru_cache(maxsize=4096)
def shard_queue_name(queue: str, index: int, count: int) -> str:
    """The hash-tagged name of shard `index` of `count` of `queue`, in its range of slots."""
    low, high = index * NUM_SLOTS // count, (index + 1) * NUM_SLOTS // count
    k = 0
    while True:
        name = "{" + f"{queue}.{index}" + (f".{k}" if k else "") + "}"
        if low <= slot_of(name) < high:
            return name
        k += 1


def shard_name(tag: str, name: str) -> str:
    """`name` (a batch id, a notify id) as written into a job of the shard with `tag`: the keys
    built from it share the job's slot. With no tag, `name` itself."""
    return tag + name


@dataclass(frozen=True, slots=True)
class QueueShards:
    """The shards of one logical queue: `count` of them, tagged when `count` > 1 or when the
    Redis is a cluster (`tagged`), where even one shard needs a tag."""

    queue: str
    count: int = 1
    tagged: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or not 1 <= self.count <= MAX_SHARDS:
            raise ValueError(
                f"queue_shards must be an integer 1 to {MAX_SHARDS}, got {self.count!r}"
            )
        if self.sharded and ("{" in self.queue or "}" in self.queue):
            raise ValueError(
                f"queue {self.queue!r}: a sharded or cluster queue's name may not contain "
                "'{' or '}' (pagedq adds the hash tags itself)"
            )

    @property
    def sharded(self) -> bool:
        """True when names carry hash tags."""
        return self.count > 1 or self.tagged

    @property
    def names(self) -> list[str]:
        """The shards' queue names, shard 0 first (just `queue` when not sharded)."""
        return [self.name(i) for i in range(self.count)]

    def name(self, index: int) -> str:
        """The queue name of shard `index` (``{queue.index}`` or ``{queue.index.k}``)."""
        return shard_queue_name(self.queue, index, self.count) if self.sharded else self.queue

    def index(self, plain_id: str) -> int:
        """The shard of a job by its plain id (sha256, so the spread is even)."""
        if self.count == 1:
            return 0
        return int.from_bytes(hashlib.sha256(plain_id.encode()).digest()[:8], "big") % self.count

    def place(self, plain_id: str) -> tuple[str, str]:
        """(job id, shard queue name) of a job whose id before placement is `plain_id`."""
        if not self.sharded:
            return plain_id, self.queue
        shard = self.name(self.index(plain_id))
        return shard + plain_id, shard
