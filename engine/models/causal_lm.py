"""What every decoder-only family shares: embeddings, the layer loop, the final norm, the LM head,
prepacking for the CPU, and loading Hugging Face named tensors. A family file only builds its
layers (``make_layer``) and says how its checkpoint names differ."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.kv_cache_spec import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from engine.models.linear import load_param
from engine.models.norm import RMSNorm
from engine.models.packed_linear import pack, prepack_supported
from engine.models.rotary import RotaryEmbedding
from engine.parallel.layers import ParallelLMHead, VocabParallelEmbedding, gathered_logits
from engine.parallel.state import tp_size

# Checkpoint projections that land in one merged layer: name -> (merged name, shard).
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


class CausalLM(nn.Module):
    """The model over a flat batch of tokens: ``forward`` gives hidden states, then logits.

    Subclasses set ``self.layers`` (each with a ``rope_key`` naming its rotary embedding in
    ``self.rotaries``) and may set ``embed_scale`` (Gemma, Granite), ``logits_scale`` (Granite's
    ``1 / logits_scaling``, Falcon-H1's ``lm_head_multiplier``) and ``final_logit_softcapping``.
    """

    packed_modules = PACKED_MODULES

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.max_position = max_position
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale: float | None = None
        self.final_logit_softcapping: float | None = None
        self.logits_scale: float | None = None
        self.rotaries: dict[str, RotaryEmbedding] = {}
        self.layers = nn.ModuleList()
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.packed_lm_head = None
        # Set by the loader from generation_config.json: where generation also stops.
        self.generation_eos_token_ids: frozenset[int] = frozenset()

    def make_norm(self, unit_offset: bool = False) -> RMSNorm:
        """The final norm (and any hidden-size norm) of this config."""
        return RMSNorm(self.config.hidden_size, self.config.rms_norm_eps, self.backend, unit_offset)

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], meta) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` of one flat batch; ``kv_caches`` and ``meta``
        (the attention metadata of the layer's group) per layer."""
        hidden = self.embed(input_ids, positions)
        lengths = self.rope_lengths(positions, meta[0]) if meta else None
        ropes = {
            key: rotary.cos_sin(positions, hidden.dtype, lengths)
            for key, rotary in self.rotaries.items()
        }
        residual = None
        for layer, kv_cache, layer_meta in zip(self.layers, kv_caches, meta):
            rope = ropes.get(layer.rope_key)  # None: a layer without rotary (NoPE)
            hidden, residual = layer(rope, hidden, residual, kv_cache, layer_meta)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The first layer's input: the token embeddings, scaled by ``embed_scale`` where set;
        families with absolute positions or an embedding norm (BLOOM) add them here."""
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            # In the model's dtype, as Gemma rounds its normalizer.
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        return hidden

    @property
    def uses_prompt_lens(self) -> bool:
        """True when the model runner must fill ``meta.num_prompt_tokens`` (``rope_lengths``)."""
        return any(rotary.length_dependent for rotary in self.rotaries.values())

    def rope_lengths(self, positions: torch.Tensor, meta) -> torch.Tensor | None:
        """For a length-dependent RoPE (dynamic, longrope): the sequence length each token's
        frequencies are computed for, as Hugging Face's ``generate`` does: a prompt of ``L``
        tokens rotates for ``L``, a generated token at position ``p`` for ``p + 1``."""
        prompt_lens = meta.num_prompt_tokens
        if prompt_lens is None:
            return None
        query_lens = meta.query_start_loc.diff()
        per_token = prompt_lens.repeat_interleave(query_lens, output_size=positions.shape[0])
        return torch.maximum(per_token, positions + 1)

    def kv_cache_specs(self) -> list[FullAttentionSpec]:
        """What each paged KV cache keeps per token, in layer order: one per layer, except that
        a layer reading another's cache (``kv_shared_from``, Gemma 4) has none."""
        specs = []
        for layer in self.layers:
            if getattr(layer, "kv_shared_from", None) is not None:
                continue
            attn = layer.self_attn
            window = attn.sliding_window
            chunk = getattr(attn, "attention_chunk_size", None)
            if chunk is not None:
                specs.append(
                    ChunkedLocalAttentionSpec(
                        attn.num_kv_heads, attn.head_dim, attention_chunk_size=chunk
                    )
                )
            elif window is None:
                specs.append(FullAttentionSpec(attn.num_kv_heads, attn.head_dim))
            else:
                specs.append(SlidingWindowSpec(attn.num_kv_heads, attn.head_dim, window))
        return specs

    def kv_cache_indices(self) -> list[int]:
        """For each layer, the index of the cache it uses in ``kv_cache_specs()``'s list."""
        indices = getattr(self, "_kv_cache_indices", None)
        if indices is None:
            own: dict[int, int] = {}
            indices = []
            for i, layer in enumerate(self.layers):
                source = getattr(layer, "kv_shared_from", None)
                if source is None:
                    own[i] = len(own)
                indices.append(own[i if source is None else source])
            self._kv_cache_indices = indices
        return indices

    def move_rotaries(self, device: torch.device) -> None:
        """Move every fp32 cos/sin cache to ``device``."""
        for rotary in self.rotaries.values():
            rotary.to_device(device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 of the rows that need sampling: fp32 sums of the model dtype's
        products, not rounded to that dtype first (bf16's ties flip greedy choices)."""
        if self.packed_lm_head is not None:
            logits = self.packed_lm_head(hidden)
        else:
            weight = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
            logits = gathered_logits(hidden, weight, self.config.vocab_size)
        if self.logits_scale is not None:
            logits = logits * self.logits_scale
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def greedy_token_ids(self, hidden: torch.Tensor) -> list[int] | None:
        """``compute_logits(hidden).argmax(-1)`` where the packed LM head can take the argmax in
        its GEMM (no logits written), else None. Soft-capping and a positive ``logits_scale`` are
        monotonic: same argmax."""
        head = self.packed_lm_head
        if head is None or not head.fuses_argmax(hidden.shape[0]):
            return None
        return head.argmax(hidden).tolist()

    def prepack(self) -> bool:
        """Reorder every linear of the layers and the LM head for the CPU GEMM that this host
        measured fastest; the packed LM head gives fp32 logits (unrounded sums).

        Idempotent; call after the weights are loaded and the model is on its device and dtype.
        A tied LM head gets its own packed copy: the embedding still needs the plain table.
        """
        weight = self.embed_tokens.weight
        if self.packed_lm_head is not None or not prepack_supported(weight.device, weight.dtype):
            return self.packed_lm_head is not None
        if tp_size() > 1:  # a packed row-parallel layer would drop its all-reduce
            return False
        packed: dict[int, nn.Module] = {}  # a linear that several layers share is packed once
        for module in list(self.layers.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear) and not getattr(child, "no_prepack", False):
                    if id(child) not in packed:
                        packed[id(child)] = pack(child)
                    setattr(module, name, packed[id(child)])
        if self.tie_word_embeddings:
            self.packed_lm_head = pack(_Tied(weight), torch.float32)
        else:
            self.lm_head = self.packed_lm_head = pack(self.lm_head, torch.float32)
        return True

    def weight_bytes(self) -> int:
        """Bytes of the weights this process holds: parameters, and the copies packed for the
        CPU (linears' ``packed`` tensor, MoE experts' tuple), each storage counted once."""
        tensors = list(self.parameters())
        for module in self.modules():
            packed = getattr(module, "packed", None)
            if isinstance(packed, torch.Tensor):
                tensors.append(packed)
            elif isinstance(packed, tuple):
                tensors += [t for t in packed if isinstance(t, torch.Tensor)]
        sizes: dict[int, int] = {}
        for t in tensors:
            try:
                storage = t.untyped_storage()
                sizes[storage.data_ptr()] = storage.nbytes()
            except NotImplementedError:  # oneDNN's packed weight: no storage to share
                sizes[id(t)] = t.numel() * t.element_size()
        return sum(sizes.values())

    def checkpoint_name(self, name: str) -> str | None:
        """Our parameter name for checkpoint tensor ``name`` (without ``model.``), or None to
        skip it. Families override this for names of their own."""
        if "rotary_emb" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
            return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face named tensors, merging split projections into their merged layers.

        A checkpoint whose weights do not match the config is refused naming the first bad
        tensor: an unknown name, a wrong shape, or (after all) a missing one.
        """
        params = dict(self.named_parameters())
        loaded: set[tuple[str, object]] = set()
        for hf_name, tensor in weights:
            name = self.checkpoint_name(hf_name.removeprefix("model."))
            if name is None:
                continue
            target, shard = self.split_target(name)
            if target not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {self.config.model_type}")
            load_param(params[target], tensor, shard, hf_name)
            if shard is None and hasattr(params[target], "expected_shards"):
                loaded |= {(target, s) for s in params[target].expected_shards}
            else:
                loaded.add((target, shard))
        expected = {
            (name, shard)
            for name, p in params.items()
            for shard in getattr(p, "expected_shards", {None})
        }
        missing = sorted(f"{n}" + (f" ({s})" if s else "") for n, s in expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}")

    def split_target(self, name: str) -> tuple[str, object]:
        """``(parameter name, shard)`` of a checkpoint name: a split projection goes to its
        shard of the merged layer."""
        for part, (merged, shard) in self.packed_modules.items():
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{merged}."), shard
        return name, None


class _Tied:
    """The embedding table seen as a bias-free linear layer (the tied LM head)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.bias = weight, None
