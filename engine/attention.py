"""The attention backend the model calls: paged KV writes and attention over one flat batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import plan_attention, select_backend, unified_attention, write_kv
from kernels.attention_options import check_options


@dataclass(slots=True)
class AttentionMetadata:
    """Layout of one step's flat varlen batch, shared by every layer.

    The model runner builds one per step; the first layer adds the backend's plan (``plan``,
    ``plan_backend``) so that the other layers reuse it. A runner that reuses one object across
    steps must reset ``plan_backend = None`` whenever the layout tensors change.
    """

    slot_mapping: torch.Tensor  # [num_tokens] flat slot of each token's K/V
    query_start_loc: torch.Tensor  # [num_reqs + 1]
    seq_lens: torch.Tensor  # [num_reqs] context length including this step's tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks], -1 padded
    num_prompt_tokens: torch.Tensor | None = None  # [num_reqs] (length-dependent RoPE)
    # The recurrent-state group (linear attention): each request's state slot, and whether it
    # continues a state (tokens computed before this step) or starts from zeros.
    state_indices: torch.Tensor | None = None  # [num_reqs]
    has_initial_state: torch.Tensor | None = None  # [num_reqs] bool
    plan: object | None = None  # the backend's per-step plan, built by the first layer
    plan_backend: str | None = None  # the backend ``plan`` was built for
    # Chunked local attention's views of this step, by chunk (engine/chunked_local_attention.py).
    local_views: dict | None = None

    def plan_for(self, backend: str, block_size: int):
        """The step's plan for ``backend`` (built at the first call, then reused)."""
        if self.plan_backend != backend:
            self.plan = plan_attention(
                backend, self.query_start_loc, self.seq_lens, self.block_table, block_size
            )
            self.plan_backend = backend
        return self.plan


class PagedAttention:
    """Writes this step's K/V into the layer's cache, then attends over cached context.

    ``scale`` multiplies q . k (``head_dim ** -0.5``, or Gemma's ``query_pre_attn_scalar **
    -0.5``). The options default to None, plain causal attention, and every backend runs them
    (``kernels.attention_options``): ``sliding_window`` W (query position q sees keys
    q - W < k <= q, Hugging Face's ``config.sliding_window`` of that layer), ``sinks``
    ``[num_heads]`` (gpt-oss's per-head sink logits; the tensor is read at each call, so a
    parameter filled in place by the loader is seen), ``logits_soft_cap`` c (Gemma 2's
    ``attn_logit_softcapping``: scores become ``c * tanh(scores / c)``). ``attention_chunk_size``
    C (Llama 4): query position p sees keys of its own chunk only, ``C * (p // C) <= k <= p``.
    ``alibi_slopes`` ``[num_heads]`` (BLOOM, MPT): each head's scores gain
    ``slope * (k - p)``.
    """

    def __init__(
        self,
        scale: float,
        backend: str = "auto",
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        logits_soft_cap: float | None = None,
        attention_chunk_size: int | None = None,
        alibi_slopes: torch.Tensor | None = None,
    ) -> None:
        check_options(sliding_window, sinks, logits_soft_cap, alibi_slopes=alibi_slopes)
        if attention_chunk_size is not None and (
            isinstance(attention_chunk_size, bool)
            or not isinstance(attention_chunk_size, int)
            or attention_chunk_size < 1
        ):
            raise ValueError(
                f"attention_chunk_size must be None or an int >= 1, got {attention_chunk_size!r}"
            )
        self.attention_chunk_size = attention_chunk_size
        self.scale = scale
        self.backend = backend
        self.sliding_window = sliding_window
        self.sinks = sinks
        self.logits_soft_cap = logits_soft_cap
        self.alibi_slopes = alibi_slopes
        self._resolved: dict[torch.device, str] = {}

    def resolve(self, device: torch.device) -> str:
        """The concrete backend ("triton", "cpu" or "torch") used on ``device``."""
        chosen = self._resolved.get(device)
        if chosen is None:
            chosen = self._resolved[device] = select_backend(device, self.backend)
        return chosen

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        backend = self.resolve(query.device)
        if key is not None:  # None: a layer that reads another layer's cache (Gemma 4)
            write_kv(key, value, kv_cache, meta.slot_mapping, backend=backend)
        if self.attention_chunk_size is not None:
            from engine.chunked_local_attention import local_metadata

            meta = local_metadata(meta, self.attention_chunk_size, kv_cache.shape[2])
        return unified_attention(
            query,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            self.scale,
            backend=backend,
            plan=meta.plan_for(backend, kv_cache.shape[2]),
            sliding_window=self.sliding_window,
            sinks=self.sinks,
            logits_soft_cap=self.logits_soft_cap,
            alibi_slopes=self.alibi_slopes,
        )
