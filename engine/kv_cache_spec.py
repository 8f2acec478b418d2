"""What each layer keeps per token, and the groups of layers that share block tables.

vLLM's hybrid KV cache manager, in small: layers with the same spec form a group; every group
takes its blocks from one pool and keeps its own block table per request. Groups are cut to one
size, and the layer at position ``j`` of every group uses the same cache tensor: a block id
belongs to one group at a time, so the tensors are shared without clashing, and memory flows to
whichever group needs it (a window that frees blocks leaves them to the full-attention layers).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """Per-head K and V of every token."""

    num_kv_heads: int
    head_dim: int

    @property
    def page_shape(self) -> tuple[int, int]:
        """``(num_kv_heads, head_dim)`` of one token's K (and V) in the cache."""
        return (self.num_kv_heads, self.head_dim)

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


KVCacheSpec = FullAttentionSpec


@dataclass(slots=True)
class KVCacheGroup:
    """Layers with one spec; ``layer_ids[j]`` uses the shared cache tensor ``j``."""

    spec: KVCacheSpec
    layer_ids: list[int]


@dataclass(slots=True)
class KVCacheLayout:
    """The groups of a model, for each layer its group and its cache tensor, and the
    ``(num_kv_heads, head_dim)`` of each tensor."""

    groups: list[KVCacheGroup]
    layer_group: list[int]
    layer_tensor: list[int]
    tensor_shapes: list[tuple[int, int]]

    @property
    def has_windows(self) -> bool:
        """True when some group gives blocks back as its window moves on."""
        return any(isinstance(g.spec, SlidingWindowSpec) for g in self.groups)

    @property
    def block_elems(self) -> int:
        """K and V elements of one block id, per token: every tensor at that id."""
        return 2 * sum(heads * dim for heads, dim in self.tensor_shapes)


def make_layout(specs: list[KVCacheSpec]) -> KVCacheLayout:
    """Group the layers' specs. Specs whose page shapes differ cannot share tensors: then every
    layer keeps its own tensor in one full-attention group (windows still apply in the kernels;
    only the blocks behind them are not given back)."""
    num_layers = len(specs)
    if len({s.page_shape for s in specs}) > 1:
        group = KVCacheGroup(FullAttentionSpec(*specs[0].page_shape), list(range(num_layers)))
        return KVCacheLayout(
            [group], [0] * num_layers, list(range(num_layers)), [s.page_shape for s in specs]
        )
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
    return KVCacheLayout(groups, layer_group, layer_tensor, [specs[0].page_shape] * group_size)
