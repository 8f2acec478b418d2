"""Per-request block tables on top of the block pool, one per layer group, with automatic
prefix caching.

Every group takes its blocks from one pool (see engine/kv_cache_spec.py). A full-attention group
holds a block for every ``block_size`` tokens; a sliding-window group gives back the blocks that
fell wholly out of its window, keeping the shared null block in their place in the table. A
recurrent-state group (engine/state_cache.py) holds one state slot per running request instead.
"""

from __future__ import annotations

from engine.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from engine.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroup,
    LatentAttentionSpec,
    SlidingWindowSpec,
    TokenBlocksSpec,
)
from engine.request import Request

GroupBlocks = list[list[KVCacheBlock]]


class KVCacheManager:
    """Allocates, shares and frees the blocks of each request, in every layer group."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        groups: list[KVCacheGroup] | None = None,
        state_cache=None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups = groups or [KVCacheGroup(FullAttentionSpec(0, 0), [])]
        self.state_cache = state_cache  # a StateCache: the recurrent-state group, or None
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # The table entry of a block that fell out of a window: never read, never freed.
        self.null_block = None
        if any(isinstance(g.spec, SlidingWindowSpec) for g in self.groups):
            self.null_block = self.block_pool.get_new_blocks(1)[0]
        self.req_to_blocks: dict[str, GroupBlocks] = {}
        self.num_cached_blocks: dict[str, list[int]] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take right now."""
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests."""
        return self.block_pool.get_usage()

    def usage_by_group(self) -> list[tuple[str, int]]:
        """``(kind, blocks held)`` of each layer group, in group order."""
        held = [0] * len(self.groups)
        for blocks in self.req_to_blocks.values():
            for g, group_blocks in enumerate(blocks):
                held[g] += sum(1 for b in group_blocks if b is not self.null_block)
        usage = [(_kind(group), n) for group, n in zip(self.groups, held)]
        if self.state_cache is not None:
            usage.append(("recurrent_state", self.state_cache.num_used_slots))
        return usage

    @property
    def has_windows(self) -> bool:
        """True when some group gives blocks back as its window moves on."""
        return any(isinstance(g.spec, SlidingWindowSpec) for g in self.groups)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks one sequence of ``num_tokens`` tokens holds at most, over every group."""
        return sum(g.spec.max_blocks(num_tokens, self.block_size) for g in self.groups)

    def _update_block_hashes(self, request: Request) -> None:
        hashes, bs = request.block_hashes, self.block_size
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            start = len(hashes) * bs
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[start : start + bs]))

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """The longest run of cached full blocks at the start of ``request``'s tokens that
        every group can serve, as each group's blocks (null where a window needs none).

        The hit stops at least one token short of the whole sequence: the last token must be
        recomputed to produce the logits the next sample needs.
        """
        none: GroupBlocks = [[] for _ in self.groups]
        if not self.enable_caching:
            return none, 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        # A full-attention group serves any prefix of its cached run; a window only the hit
        # lengths whose last window of blocks is cached, so the hit is searched downwards.
        num_hit = max_hit_blocks
        for g, group in enumerate(self.groups):
            if not isinstance(group.spec, SlidingWindowSpec):
                num_hit = min(num_hit, self._cached_run(g, request, num_hit))
        while num_hit > 0 and not all(
            self._window_cached(g, request, num_hit)
            for g, group in enumerate(self.groups)
            if isinstance(group.spec, SlidingWindowSpec)
        ):
            num_hit -= 1
        # A recurrent state is only known where a snapshot was kept; elsewhere, recompute.
        while self.state_cache is not None and num_hit > 0:
            if self.state_cache.has_snapshot(request.block_hashes[num_hit - 1]):
                break
            num_hit -= 1
        hits = [self._hit_blocks(g, request, num_hit) for g in range(len(self.groups))]
        num_hit_tokens = num_hit * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return hits, num_hit_tokens

    def _cached(self, g: int, request: Request, i: int) -> KVCacheBlock | None:
        return self.block_pool.get_cached_block((g, request.block_hashes[i]))

    def _cached_run(self, g: int, request: Request, limit: int) -> int:
        n = 0
        while n < limit and self._cached(g, request, n) is not None:
            n += 1
        return n

    def _window_cached(self, g: int, request: Request, num_hit: int) -> bool:
        first = self.groups[g].spec.first_needed_block(num_hit * self.block_size, self.block_size)
        return all(self._cached(g, request, i) is not None for i in range(first, num_hit))

    def _hit_blocks(self, g: int, request: Request, num_hit: int) -> list[KVCacheBlock]:
        first = self.groups[g].spec.first_needed_block(num_hit * self.block_size, self.block_size)
        return [self.null_block] * first + [
            self._cached(g, request, i) for i in range(first, num_hit)
        ]

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: GroupBlocks | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens in every group; returns the new blocks,
        or None (and no change but blocks a window had already left) if blocks run out."""
        hits = new_computed_blocks or [[] for _ in self.groups]
        rid = request.request_id
        if self.state_cache is not None and not self.state_cache.has_room(rid):
            return None
        blocks = self.req_to_blocks.get(rid) or [[] for _ in self.groups]
        self._skip_out_of_window(blocks, request.num_computed_tokens)
        num_computed = request.num_computed_tokens + len(hits[0]) * self.block_size
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new = [num_required - len(b) - len(h) for b, h in zip(blocks, hits)]
        # Touching a cached block that is free takes it out of the free queue too.
        real_hits = [b for h in hits for b in h if b is not self.null_block]
        num_evictable_hits = sum(1 for b in real_hits if b.ref_cnt == 0)
        if sum(max(n, 0) for n in num_new) > self.num_free_blocks - num_evictable_hits:
            if not any(blocks):
                self.req_to_blocks.pop(rid, None)
            return None
        self.block_pool.touch(real_hits)
        out = []
        for group_blocks, group_hits, n in zip(blocks, hits, num_new):
            group_blocks.extend(group_hits)
            new_blocks = self.block_pool.get_new_blocks(max(n, 0))
            group_blocks.extend(new_blocks)
            out.extend(new_blocks)
        self.req_to_blocks[rid] = blocks
        if self.state_cache is not None:
            self.state_cache.allocate(rid)
            if hits[0]:
                self.state_cache.restore(rid, request.block_hashes[len(hits[0]) - 1])
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return out

    def _state_snapshot_tokens(self, request: Request) -> int:
        # The end of the prompt's last block that a later hit can use (a hit leaves at least
        # one token to compute): a repeated prompt, or a shared system prompt followed by less
        # than a block, starts from here.
        return (request.num_prompt_tokens - 1) // self.block_size * self.block_size

    def cap_at_state_snapshot(self, request: Request, num_computed: int, num_new: int) -> int:
        """``num_new`` cut so that a hybrid model's prefill stops at the block boundary whose
        state is snapshotted (with prefix caching on), else unchanged."""
        if self.state_cache is None or not self.enable_caching:
            return num_new
        point = self._state_snapshot_tokens(request)
        return point - num_computed if num_computed < point < num_computed + num_new else num_new

    def save_state_snapshots(self, scheduled) -> None:
        """After a step: snapshot the state of every request whose computed tokens now end at
        its snapshot point, keyed by the hash of the block ending there."""
        if self.state_cache is None or not self.enable_caching:
            return
        for s in scheduled:
            request = s.request
            point = self._state_snapshot_tokens(request)
            if point > 0 and request.num_computed_tokens + s.num_new_tokens == point:
                key = request.block_hashes[point // self.block_size - 1]
                self.state_cache.save_snapshot(request.request_id, key)

    def _skip_out_of_window(self, blocks: GroupBlocks, first_query_pos: int) -> None:
        # Blocks wholly before a window give way to the null block; a table that does not reach
        # the window yet (a swapped request coming back) starts with nulls up to it.
        for group, group_blocks in zip(self.groups, blocks):
            first = group.spec.first_needed_block(first_query_pos, self.block_size)
            if first == 0:
                continue
            gone = [b for b in group_blocks[:first] if b is not self.null_block]
            group_blocks[:first] = [self.null_block] * first
            self.block_pool.free_blocks(reversed(gone))

    def _cache_full_blocks(self, request: Request, blocks: GroupBlocks, num_tokens: int):
        # Hashes are published at schedule time: the KV of every scheduled token is written
        # before any attention of the same layer reads it, so a sibling in the same step may hit.
        self._update_block_hashes(request)
        starts = self.num_cached_blocks.setdefault(request.request_id, [0] * len(self.groups))
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for g, group_blocks in enumerate(blocks):
            for i in range(starts[g], end):
                if group_blocks[i] is not self.null_block:
                    self.block_pool.cache_full_block(group_blocks[i], (g, request.block_hashes[i]))
            starts[g] = max(starts[g], end)

    def free(self, request: Request) -> None:
        """Release every block of ``request`` in every group."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        if self.state_cache is not None:
            self.state_cache.free(request.request_id)
        for group_blocks in blocks:
            # Tail blocks first, so that they are evicted before the shared prefix blocks.
            self.block_pool.free_blocks(
                b for b in reversed(group_blocks) if b is not self.null_block
            )

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The block table of one request in each group."""
        return [[b.block_id for b in group] for group in self.req_to_blocks.get(request_id, [])]

    def computed_block_ids(self, request: Request) -> list[int]:
        """The blocks holding ``request``'s computed tokens that it still reads, every group's
        in turn: what a swap copies out, and in again after the same allocation."""
        num_blocks = -(-request.num_computed_tokens // self.block_size)
        out = []
        for group, group_blocks in zip(self.groups, self.req_to_blocks.get(request.request_id, [])):
            first = group.spec.first_needed_block(request.num_computed_tokens, self.block_size)
            out.extend(b.block_id for b in group_blocks[first:num_blocks])
        return out

    def num_computed_blocks(self, request: Request) -> int:
        """How many blocks ``computed_block_ids`` gives, without a request's table."""
        n, bs = request.num_computed_tokens, self.block_size
        return sum(-(-n // bs) - g.spec.first_needed_block(n, bs) for g in self.groups)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the cache over tokens looked up."""
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


def _kind(group: KVCacheGroup) -> str:
    if isinstance(group.spec, ChunkedLocalAttentionSpec):
        return f"attention_chunk_size={group.spec.attention_chunk_size}"
    if isinstance(group.spec, SlidingWindowSpec):
        return f"sliding_window={group.spec.sliding_window}"
    if isinstance(group.spec, LatentAttentionSpec):
        return "latent_attention"
    if isinstance(group.spec, TokenBlocksSpec):
        return "token_blocks"
    return "full_attention"
