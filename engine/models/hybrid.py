"""What hybrid families share: layers whose mixer keeps a state slot per sequence
(engine/state_cache.py) beside full-attention layers with paged KV.

A stateful mixer has ``state_spec()`` (its ``RecurrentStateSpec``) and ``bind_state(conv,
ssm)``; it takes no KV cache and reads the first group's metadata (``query_start_loc``,
``state_indices``, ``has_initial_state``)."""

from __future__ import annotations

import torch
from torch import nn

from engine.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from engine.parallel.state import tp_rank, tp_size
from engine.state_cache import RecurrentStateSpec


def is_stateful(mixer: nn.Module | None) -> bool:
    """True for a mixer that keeps a state slot per sequence instead of paged KV."""
    return hasattr(mixer, "state_spec")


def mixer_of(layer: nn.Module) -> nn.Module | None:
    """A layer's token mixer (``self_attn``), or None for a layer without one (Nemotron-H's MLP
    and MoE blocks), which takes neither KV nor a state."""
    return getattr(layer, "self_attn", None)


def takes_kv(layer: nn.Module) -> bool:
    """True for a layer with paged KV: a mixer that is not stateful."""
    mixer = mixer_of(layer)
    return mixer is not None and not is_stateful(mixer)


def kv_spec_of(mixer: nn.Module) -> KVCacheSpec:
    """What an attention mixer keeps per token: its own ``kv_cache_spec()`` where it has one,
    else per-head K and V (of its window's last positions only, for a sliding layer: LFM3)."""
    own = getattr(mixer, "kv_cache_spec", None)
    if own is not None:
        return own()
    window = getattr(mixer, "sliding_window", None)
    if window is not None:
        return SlidingWindowSpec(mixer.num_kv_heads, mixer.head_dim, window)
    return FullAttentionSpec(mixer.num_kv_heads, mixer.head_dim)


class HybridLayers:
    """Mixin of a ``CausalLM`` whose ``layers`` mix stateful mixers and full attention."""

    def _stateful_mixers(self) -> list[nn.Module]:
        mixers = [mixer_of(layer) for layer in self.layers]
        return [m for m in mixers if is_stateful(m)]

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """The attention layers' specs only: ``kv_caches`` and ``meta`` hold one entry per
        attention layer, in order. A mixer with a ``kv_cache_spec()`` of its own (latent
        attention: Kimi Linear) gives it; any other keeps per-head K and V."""
        return [kv_spec_of(layer.self_attn) for layer in self.layers if takes_kv(layer)]

    def kv_cache_indices(self) -> list[int]:
        """One cache per full-attention layer, in order (the stateful layers take none)."""
        return list(range(len(self.kv_cache_specs())))

    def recurrent_state_specs(self) -> list[RecurrentStateSpec]:
        """The stateful layers' per-sequence states, in order."""
        return [mixer.state_spec() for mixer in self._stateful_mixers()]

    def bind_state_cache(self, cache) -> None:
        """Point every stateful layer at its pools of ``cache`` (an engine StateCache)."""
        for j, mixer in enumerate(self._stateful_mixers()):
            mixer.bind_state(cache.conv_states[j], cache.ssm_states[j])

    def per_layer(self, kv_caches, meta) -> tuple[list, list]:
        """Each layer's KV cache (None for a stateful layer) and metadata (a stateful layer
        reads the first group's)."""
        caches, metas = iter(kv_caches), iter(meta)
        layer_caches, layer_meta = [], []
        for layer in self.layers:
            kv = takes_kv(layer)
            layer_caches.append(next(caches) if kv else None)
            layer_meta.append(next(metas) if kv else meta[0])
        return layer_caches, layer_meta

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        return super().forward(input_ids, positions, *self.per_layer(kv_caches, meta))


def split_by_heads(param: nn.Parameter, shards: dict[str | None, list[int]]) -> None:
    """``param`` loads from whole checkpoint tensors: ``shards`` maps each (``None``: the
    parameter's own tensor, all of it) to the sizes of its consecutive row blocks (q, k, v, ...).
    This rank keeps its ``1 / N`` of every block, the named shards side by side in order; a
    checkpoint may hold either the whole tensor or every named shard."""
    n, offsets, offset = tp_size(), {None: 0}, 0
    for name, sizes in shards.items():
        if name is not None:
            offsets[name] = offset
            offset += sum(sizes) // n

    def load(p: nn.Parameter, tensor: torch.Tensor, shard: str | None) -> None:
        sizes = shards[shard]
        blocks = tensor.split(sizes)
        local = torch.cat(
            [b.narrow(0, tp_rank() * (s // n), s // n) for b, s in zip(blocks, sizes)]
        )
        p.data[offsets[shard] : offsets[shard] + local.shape[0]].copy_(local)

    param.weight_loader = load
    param.checkpoint_shape = lambda shard: (sum(shards[shard]), *param.shape[1:])
    named = {name for name in shards if name is not None}
    if named:  # the whole tensor, where loaded, stands for all of them
        param.expected_shards = named
