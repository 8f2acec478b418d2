"""Physical KV blocks: ref counts, an O(1) free queue with LRU eviction, and the prefix cache."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

BlockHash = bytes
"""A block's prefix-cache key: a 32-byte BLAKE2b digest of its parent's key and its tokens."""

_NO_PARENT = b"\x00" * 32


class KVCacheBlock:
    """Metadata of one physical block. ``block_hash`` is set once the block is full and cached."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks; the head is the least recently freed, evicted first.

    Removal from the middle is O(1), which a prefix-cache hit on a free block needs.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Take the least recently freed block."""
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` wherever it is."""
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail: the most recently freed."""
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks from head (next to evict) to tail."""
        out, block = [], self._head.next_free
        while block is not self._tail:
            out.append(block)
            block = block.next_free
        return out


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Iterable[int]) -> BlockHash:
    """Chained key of one full block: equal keys mean equal whole prefixes.

    A cryptographic digest, because Python's ``hash()`` of a tuple of ints is the same in every
    process and cheap to invert: anyone who can submit prompts could craft a block that collides
    with another user's cached prefix and be served its KV.
    """
    ids = tuple(token_ids)
    packed = struct.pack(f"<{len(ids)}q", *ids)
    return hashlib.blake2b(
        (parent_hash or _NO_PARENT) + packed, digest_size=32, person=b"pagedq-kv"
    ).digest()


class BlockPool:
    """Owns every block of the KV cache and the map from block hash to cached block."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} is invalid: must be >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        """Blocks with no owner (some may still hold evictable cached content)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks held by requests."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The cached block for ``block_hash``, if any."""
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` free blocks, evicting the least recently used cached ones."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} blocks: {self.get_num_free_blocks()} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each; blocks reaching zero join the free queue in this order."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Publish a full block under ``block_hash`` (the first block with a hash keeps it)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block.setdefault(block_hash, block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (only the free blocks' content is lost)."""
        for block in self.blocks:
            if block.ref_cnt == 0:
                self._evict(block)
