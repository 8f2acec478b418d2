"""DeepSeek Sparse Attention (DeepSeek-V3.2 ``deepseek_v32``, GLM-5 ``glm_moe_dsa``): latent
attention whose queries each attend to ``index_topk`` chosen keys only.

A lightning indexer scores every cached key for each query: ``sum_h w_h * relu(scale * q_h .
k)``, its own small queries (``wq_b`` on the query LoRA's normed latent), one key per token
(``wk``, a LayerNorm, RoPE on its first ``qk_rope_head_dim`` features: half-split in V3.2,
interleaved in GLM-5) and per-head weights (``weights_proj``); the top ``index_topk`` of the
causally visible keys are kept (transformers' eager reference, which pagedq matches; the
released kernels' Hadamard rotation and FP8 scoring change no selection but rounding).

Each token's indexer key lives in the layer's latent cache row, after ``[c | k_pe]``, so it is
paged, prefix-cached and swapped with the row. While every sequence of a step is at most
``index_topk`` tokens long every visible key is kept: the dense latent-attention kernels run
unchanged. Past it, the step's attention runs on the torch path with each query's selection as
a mask (the selection's kernels on the C++ and Triton backends are still to come).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.kv_cache_spec import LatentAttentionSpec
from engine.models.latent_attention import LatentAttention
from engine.models.rotary import deinterleave
from kernels import apply_rotary
from kernels.mla import mla_attention

# Queries scored at a time on the sparse path: bounds the [queries, heads, keys] score tensors.
QUERY_BLOCK = 256


class Indexer(nn.Module):
    """The lightning indexer of one layer (replicated on every tensor-parallel rank: it is
    small, and every rank's heads read the same selection)."""

    def __init__(self, config, backend: str, rope_interleave: bool) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim, self.topk = config.qk_rope_head_dim, config.index_topk
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.scale = self.head_dim**-0.5
        self.rope_interleave = rope_interleave
        self.backend = backend

    def _rotate(self, x: torch.Tensor, rope) -> torch.Tensor:
        """RoPE on the first ``rope_dim`` features of ``x`` ``[T, heads, head_dim]``."""
        cos, sin = rope[0], rope[1]
        part = x[..., : self.rope_dim]
        if self.rope_interleave:
            part = deinterleave(part)
        part = apply_rotary(part.contiguous(), cos, sin, backend=self.backend)
        return torch.cat((part, x[..., self.rope_dim :]), dim=-1)

    def keys(self, hidden: torch.Tensor, rope) -> torch.Tensor:
        """Each token's indexer key ``[T, head_dim]``."""
        return self._rotate(self.k_norm(self.wk(hidden))[:, None], rope)[:, 0]

    def queries(self, q_resid: torch.Tensor, hidden: torch.Tensor, rope):
        """``(queries [T, heads, head_dim], head weights fp32 [T, heads])``."""
        q = self.wq_b(q_resid).view(q_resid.shape[0], self.n_heads, self.head_dim)
        weights = self.weights_proj(hidden).float() * self.n_heads**-0.5
        return self._rotate(q, rope), weights

    def select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, first_pos: int):
        """``[queries, keys]`` bool: the keys each query attends to, the ``topk`` best of those
        causally visible (query ``i`` at position ``first_pos + i``)."""
        scores = torch.einsum("qhd,kd->qhk", q.float(), keys.float()) * self.scale
        index = torch.einsum("qh,qhk->qk", weights, scores.relu())
        query_pos = torch.arange(first_pos, first_pos + q.shape[0], device=q.device)
        key_pos = torch.arange(keys.shape[0], device=q.device)
        visible = key_pos[None, :] <= query_pos[:, None]
        index = index.masked_fill(~visible, float("-inf"))
        chosen = index.topk(min(self.topk, keys.shape[0]), dim=-1).indices
        selected = torch.zeros_like(visible).scatter_(1, chosen, True)
        return selected & visible


class IndexedLatentAttention(LatentAttention):
    """Latent attention under the indexer's selection; the indexer key of each token written
    after its latent row."""

    def __init__(
        self, config, backend: str = "auto", rope_interleave: bool | None = None,
        indexer_rope_interleave: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(config, backend, rope_interleave)
        if config.q_lora_rank is None:
            raise ValueError(
                f"model_type={config.model_type!r} needs q_lora_rank: its indexer reads the "
                "query LoRA's latent"
            )
        self.indexer = Indexer(config, backend, indexer_rope_interleave)

    def kv_cache_spec(self) -> LatentAttentionSpec:
        """The latent row and the indexer's key per token."""
        return LatentAttentionSpec(self.kv_lora_rank, self.rope_dim, self.indexer.head_dim)

    def attend(self, q_latent, q_pe, kv_cache, meta, backend, rope, hidden, q_resid):
        width = self.kv_lora_rank + self.rope_dim
        keys = self.indexer.keys(hidden, rope)
        valid = meta.slot_mapping >= 0
        slots = meta.slot_mapping[valid].long()
        block_size = kv_cache.shape[1]
        kv_cache[slots // block_size, slots % block_size, width:] = keys[valid].to(kv_cache.dtype)
        latent_cache = kv_cache[..., :width]
        if meta.seq_lens.numel() == 0 or int(meta.seq_lens.max()) <= self.indexer.topk:
            return mla_attention(
                q_latent, q_pe, latent_cache, meta.query_start_loc, meta.seq_lens,
                meta.block_table, self.scale, backend=backend,
            )  # fmt: skip
        q_index, weights = self.indexer.queries(q_resid, hidden, rope)
        return self._sparse(q_latent, q_pe, q_index, weights, kv_cache, meta)

    def _sparse(self, q_latent, q_pe, q_index, weights, kv_cache, meta: AttentionMetadata):
        """Each request's rows gathered, each query's scores masked to its selection (fp32)."""
        rank, width = self.kv_lora_rank, self.kv_lora_rank + self.rope_dim
        dtype = torch.promote_types(q_latent.dtype, torch.float32)
        out = torch.empty_like(q_latent)
        block_size = kv_cache.shape[1]
        bounds, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            seq_len = lens[i]
            blocks = meta.block_table[i, : -(-seq_len // block_size)].long()
            rows = kv_cache[blocks].reshape(-1, kv_cache.shape[2])[:seq_len]
            latent, keys = rows[:, :width].to(dtype), rows[:, width:]
            for s in range(start, end, QUERY_BLOCK):
                e = min(end, s + QUERY_BLOCK)
                first_pos = seq_len - (end - start) + (s - start)
                chosen = self.indexer.select(q_index[s:e], weights[s:e], keys, first_pos)
                q = torch.cat([q_latent[s:e], q_pe[s:e]], dim=-1).to(dtype)
                scores = torch.einsum("qhd,kd->hqk", q, latent) * self.scale
                probs = scores.masked_fill(~chosen[None], float("-inf")).softmax(dim=-1)
                out[s:e] = torch.einsum("hqk,kl->qhl", probs, latent[:, :rank]).to(out.dtype)
        return out
