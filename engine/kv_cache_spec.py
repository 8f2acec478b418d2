"""What each layer keeps per token, and the groups of layers that share block tables.

vLLM's hybrid KV cache manager, in small: layers with the same spec form a group; every group
takes its blocks from one pool and keeps its own block table per request. Groups are cut to one
size, and the layer at position ``j`` of every group uses the same cache tensor: a block id
belongs to one group at a time, so the tensors are shared without clashing, and memory flows to
whichever group needs it (a window that frees blocks leaves them to the full-attention layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """Per-head K and V of every token."""

    num_kv_heads: int
    head_dim: int
    # The layer's tensor is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
    block_dim: ClassVar[int] = 1

    @property
    def page_shape(self) -> tuple[int, int]:
        """``(num_kv_heads, head_dim)`` of one token's K (and V) in the cache."""
        return (self.num_kv_heads, self.head_dim)

    @property
    def token_elems(self) -> int:
        """Values one token keeps in one layer: its K and its V."""
        return 2 * self.num_kv_heads * self.head_dim

    def first_needed_block(self, first_query_pos: int, block_size: int) -> int:
        """The first block a query at ``first_query_pos`` or later still reads."""
        return 0

    def max_blocks(self, num_tokens: int, block_size: int) -> int:
        """Blocks one sequence of ``num_tokens`` holds at most."""
        return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(FullAttentionSpec):
    """K and V of the last ``sliding_window`` positions only: a key at ``k`` is seen by a query
    at ``q`` while ``q - sliding_window < k``, so blocks wholly before that are given back."""

    sliding_window: int = 0

    def first_needed_block(self, first_query_pos: int, block_size: int) -> int:
        return max(0, first_query_pos - self.sliding_window + 1) // block_size

    def max_blocks(self, num_tokens: int, block_size: int) -> int:
        # A decode at position p reads [p - W + 1, p]: W tokens over at most
        # ceil((W - 1) / block_size) + 1 blocks.
        window_blocks = -(-(self.sliding_window - 1) // block_size) + 1
        return min(-(-num_tokens // block_size), window_blocks)


@dataclass(frozen=True, slots=True)
class ChunkedLocalAttentionSpec(SlidingWindowSpec):
    """K and V of the query's own chunk (Llama 4's ``attention_chunk_size`` C, a whole number of
    blocks): a query at ``p`` reads keys from ``C * (p // C)`` on, so the blocks of earlier
    chunks are given back as a window's are."""

    attention_chunk_size: int = 0

    def first_needed_block(self, first_query_pos: int, block_size: int) -> int:
        chunk = self.attention_chunk_size
        return first_query_pos // chunk * chunk // block_size

    def max_blocks(self, num_tokens: int, block_size: int) -> int:
        return min(-(-num_tokens // block_size), self.attention_chunk_size // block_size + 1)


@dataclass(frozen=True, slots=True)
class LatentAttentionSpec:
    """Multi-head latent attention (DeepSeek-V2/V3): one compressed latent and one rope key per
    token, shared by every head, no separate K and V (``kernels/mla.py``): 512 + 64 = 576 values
    at DeepSeek-V3's sizes. Every token is kept, as with full attention."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    # DeepSeek Sparse Attention: the indexer's key of each token, after the latent row.
    index_head_dim: int = 0
    # The layer's tensor is ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim
    # (+ index_head_dim)]``.
    block_dim: ClassVar[int] = 0

    @property
    def page_shape(self) -> tuple[int]:
        """``(token_elems,)``: one token's row of the latent cache."""
        return (self.token_elems,)

    @property
    def token_elems(self) -> int:
        """Values one token keeps in one layer: its latent row (and indexer key)."""
        return self.kv_lora_rank + self.qk_rope_head_dim + self.index_head_dim

    def first_needed_block(self, first_query_pos: int, block_size: int) -> int:
        """The first block a query at ``first_query_pos`` or later still reads."""
        return 0

    def max_blocks(self, num_tokens: int, block_size: int) -> int:
        """Blocks one sequence of ``num_tokens`` holds at most."""
        return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class TokenBlocksSpec:
    """The block table of a model without attention layers (a pure Mamba-2 LM): no layer reads
    it, but its blocks count each sequence's tokens, so that admission, preemption, prefix-cache
    hashes and the recurrent states' snapshots run as they do for the hybrids. One value per
    token, never written."""

    block_dim: ClassVar[int] = 0

    @property
    def page_shape(self) -> tuple[int]:
        """``(1,)``: the smallest page the cache allocator takes."""
        return (1,)

    @property
    def token_elems(self) -> int:
        """Values one token keeps: one, unused."""
        return 1

    def first_needed_block(self, first_query_pos: int, block_size: int) -> int:
        """Every block is kept: a prefix-cache hit needs the whole sequence's hashes."""
        return 0

    def max_blocks(self, num_tokens: int, block_size: int) -> int:
        """Blocks one sequence of ``num_tokens`` holds at most."""
        return -(-num_tokens // block_size)


KVCacheSpec = FullAttentionSpec | LatentAttentionSpec | TokenBlocksSpec


@dataclass(slots=True)
class KVCacheGroup:
    """Layers with one spec; ``layer_ids[j]`` uses the shared cache tensor ``j``."""

    spec: KVCacheSpec
    layer_ids: list[int]


@dataclass(slots=True)
class KVCacheLayout:
    """The groups of a model, for each layer its group and its cache tensor, and the spec of
    each tensor (what one token keeps there)."""

    groups: list[KVCacheGroup]
    layer_group: list[int]
    layer_tensor: list[int]
    tensor_specs: list[KVCacheSpec]

    @property
    def tensor_shapes(self) -> list[tuple[int, ...]]:
        """Each tensor's page shape: ``(num_kv_heads, head_dim)``, or a latent row's width."""
        return [s.page_shape for s in self.tensor_specs]

    @property
    def has_windows(self) -> bool:
        """True when some group gives blocks back as its window moves on."""
        return any(isinstance(g.spec, SlidingWindowSpec) for g in self.groups)

    @property
    def block_elems(self) -> int:
        """Elements of one block id, per token: every tensor at that id (K and V, or a latent
        row)."""
        return sum(s.token_elems for s in self.tensor_specs)


def make_layout(specs: list[KVCacheSpec]) -> KVCacheLayout:
    """Group the layers' specs. Specs whose page shapes differ cannot share tensors: then every
    layer keeps its own tensor in one full-attention group (windows still apply in the kernels;
    only the blocks behind them are not given back)."""
    num_layers = len(specs)
    if len({s.page_shape for s in specs}) > 1:
        group = KVCacheGroup(_keeping_every_token(specs[0]), list(range(num_layers)))
        return KVCacheLayout([group], [0] * num_layers, list(range(num_layers)), list(specs))
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(i)
    group_size = min(len(ids) for ids in by_spec.values())
    groups, layer_group, layer_tensor = [], [0] * num_layers, [0] * num_layers
    for spec, ids in by_spec.items():
        for start in range(0, len(ids), group_size):
            chunk = ids[start : start + group_size]
            for j, layer in enumerate(chunk):
                layer_group[layer], layer_tensor[layer] = len(groups), j
            groups.append(KVCacheGroup(spec, chunk))
    return KVCacheLayout(groups, layer_group, layer_tensor, [specs[0]] * group_size)


def _keeping_every_token(spec: KVCacheSpec) -> KVCacheSpec:
    if isinstance(spec, SlidingWindowSpec):
        return FullAttentionSpec(spec.num_kv_heads, spec.head_dim)
    return spec
