"""Chunked local attention (Llama 4's ``attention_chunk_size``): a query at position p sees the
keys of its own chunk only, ``C * (p // C) <= k <= p`` (Hugging Face's ``chunked_overlay``).

No kernel changes: each request's queries are split at chunk boundaries into virtual requests,
each a plain causal request over its chunk's keys, whose block table starts at the chunk's first
block (vLLM's "local attention virtual batches"). A chunk is a whole number of KV blocks, so a
virtual request's table is a slice of its request's.
"""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata


def check_chunk(chunk: int, block_size: int) -> None:
    """Refuse a chunk that is not a whole number of KV blocks, naming both."""
    if chunk % block_size:
        raise ValueError(
            f"attention_chunk_size={chunk} must be a multiple of block_size={block_size}: "
            f"pick a block_size that divides it (16 divides every released Llama 4's 8192)"
        )


def check_model_chunks(model, block_size: int) -> None:
    """Refuse, before the first step, a model with a chunked layer that ``block_size`` does not
    divide."""
    for module in model.modules():
        chunk = getattr(getattr(module, "attn", None), "attention_chunk_size", None)
        if chunk is not None:
            check_chunk(chunk, block_size)


def local_metadata(meta: AttentionMetadata, chunk: int, block_size: int) -> AttentionMetadata:
    """``meta``'s step as virtual requests that each stay within one chunk of ``chunk`` tokens
    (``meta`` itself where no request reaches past its first chunk); built once per step and
    kept on ``meta``."""
    views = meta.local_views
    if views is None:
        views = meta.local_views = {}
    view = views.get(chunk)
    if view is None:
        view = views[chunk] = _split(meta, chunk, block_size)
    return view


def _split(meta: AttentionMetadata, chunk: int, block_size: int) -> AttentionMetadata:
    check_chunk(chunk, block_size)
    seq_lens = meta.seq_lens
    if seq_lens.numel() == 0 or int(seq_lens.max()) <= chunk:
        return meta
    device = seq_lens.device
    q_lens = meta.query_start_loc.diff()
    first = seq_lens - q_lens  # each request's first query position
    first_chunk = torch.div(first, chunk, rounding_mode="floor")
    last_chunk = torch.div((seq_lens - 1).clamp(min=0), chunk, rounding_mode="floor")
    pieces = (last_chunk - first_chunk + 1).clamp(min=1)
    request = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), pieces)
    offset = torch.arange(len(request), device=device) - (pieces.cumsum(0) - pieces)[request]
    chunk_start = (first_chunk[request] + offset) * chunk
    end = torch.minimum(seq_lens[request], chunk_start + chunk)  # one past the last query
    begin = torch.maximum(first[request], chunk_start)
    query_start_loc = torch.zeros(len(request) + 1, dtype=meta.query_start_loc.dtype, device=device)
    query_start_loc[1:] = torch.cumsum(end - begin, 0)
    table = meta.block_table
    width = min(table.shape[1], chunk // block_size)
    columns = (chunk_start // block_size)[:, None] + torch.arange(width, device=device)
    inside = columns < table.shape[1]
    block_table = table[request].gather(1, columns.clamp(max=table.shape[1] - 1))
    block_table = block_table.masked_fill(~inside, -1)
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=(end - chunk_start).to(seq_lens.dtype),
        block_table=block_table,
    )
