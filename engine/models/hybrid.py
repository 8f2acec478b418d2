"""What hybrid families share: layers whose mixer keeps a state slot per sequence
(engine/state_cache.py) beside full-attention layers with paged KV.

A stateful mixer has ``state_spec()`` (its ``RecurrentStateSpec``) and ``bind_state(conv,
ssm)``; it takes no KV cache and reads the first group's metadata (``query_start_loc``,
``state_indices``, ``has_initial_state``)."""

from __future__ import annotations

import torch
from torch import nn

from engine.kv_cache_spec import FullAttentionSpec
from engine.state_cache import RecurrentStateSpec


def is_stateful(mixer: nn.Module) -> bool:
    """True for a mixer that keeps a state slot per sequence instead of paged KV."""
    return hasattr(mixer, "state_spec")


class HybridLayers:
    """Mixin of a ``CausalLM`` whose ``layers`` mix stateful mixers and full attention."""

    def _stateful_mixers(self) -> list[nn.Module]:
        mixers = [layer.self_attn for layer in self.layers]
        return [m for m in mixers if is_stateful(m)]

    def kv_cache_specs(self) -> list[FullAttentionSpec]:
        """The full-attention layers' specs only: ``kv_caches`` and ``meta`` hold one entry per
        full-attention layer, in order."""
        return [
            FullAttentionSpec(layer.self_attn.num_kv_heads, layer.self_attn.head_dim)
            for layer in self.layers
            if not is_stateful(layer.self_attn)
        ]

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

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        caches, metas = iter(kv_caches), iter(meta)
        layer_caches, layer_meta = [], []
        for layer in self.layers:
            stateful = is_stateful(layer.self_attn)
            layer_caches.append(None if stateful else next(caches))
            layer_meta.append(meta[0] if stateful else next(metas))
        return super().forward(input_ids, positions, layer_caches, layer_meta)
