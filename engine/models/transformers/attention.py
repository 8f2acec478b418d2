"""pagedq's paged attention as a transformers attention function (``AttentionInterface``).

The wrapper runs the Hugging Face model with batch size 1 over the step's flat token batch, no
HF cache and no mask; each attention module hands its rotated q/k/v ``[1, heads, T, dim]`` to
``paged_attention_forward``, which writes K/V into that layer's paged cache and attends over
the ragged batch with the step's metadata, through the same ``PagedAttention`` (and so the same
``select_backend`` choice of C++, Triton or torch kernels) as the native layers.

The step's caches and metadata reach the function through a context variable the wrapper sets
around the forward (``step``); the layer is ``module.layer_idx``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, PagedAttention

ATTN_IMPLEMENTATION = "pagedq"

# Keyword arguments families pass that change nothing here: position and cache bookkeeping
# (there is no HF cache), and flash-attention's varlen layout (pagedq's metadata says it).
IGNORED_KWARGS = frozenset(
    {
        "position_ids", "cache_position", "use_cache", "position_embeddings", "cache",
        "past_key_values", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
        "output_attentions", "layer_idx", "target_dtype",
    }
)  # fmt: skip
# The names families give their per-head sink logits (gpt-oss's ``s_aux``).
SINK_KWARGS = ("s_aux", "sinks")
# What the probe records of one attention call: the module, its number of q heads, its k and v,
# its scale, the rest.
ProbedCall = tuple[torch.nn.Module, int, torch.Tensor, torch.Tensor, float, dict]


@dataclass(slots=True)
class LayerCall:
    """What one attention module passed at the load-time probe: its cache's page shape and its
    options."""

    module: torch.nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None
    logits_soft_cap: float | None
    sinks: torch.Tensor | None


@dataclass(slots=True)
class Step:
    """One forward's attention state: each layer's cache and metadata and its ``PagedAttention``
    (a step), or the list the probe records each call into (``probe``)."""

    kv_caches: list[torch.Tensor] | None = None
    meta: list[AttentionMetadata] | None = None
    layers: list[PagedAttention] | None = None
    probe: list[ProbedCall] | None = None


_STEP: ContextVar[Step | None] = ContextVar("pagedq_transformers_step", default=None)


@contextmanager
def step(state: Step) -> Iterator[None]:
    """Inside, ``paged_attention_forward`` reads ``state``."""
    token = _STEP.set(state)
    try:
        yield
    finally:
        _STEP.reset(token)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function: q ``[1, heads, T, dim]``, k/v ``[1, kv_heads, T,
    dim]`` of the flat batch in, ``[1, T, heads, dim]`` out."""
    state = _STEP.get()
    if state is None:
        raise RuntimeError(
            f"{type(module).__name__} ran attn_implementation={ATTN_IMPLEMENTATION!r} outside a "
            "pagedq step: this model runs only inside pagedq's engine"
        )
    if state.probe is not None:
        scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
        extra = {"dropout": dropout, "attention_mask": attention_mask, **kwargs}
        state.probe.append((module, query.shape[1], key, value, scale, extra))
        # Shaped as the layer's output: values may be narrower than queries (MLA's v_head_dim),
        # which layer_call then refuses by name.
        batch, heads, tokens, _ = query.shape
        return query.new_zeros(batch, tokens, heads, value.shape[-1]), None
    i = module.layer_idx
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    out = state.layers[i](q, k, v, state.kv_caches[i], state.meta[i])
    return out.unsqueeze(0), None


def layer_call(call: ProbedCall, config_window: int | None) -> LayerCall:
    """The ``LayerCall`` of one probed attention call (``config_window``: the config's window
    of that layer); refuses what the paged kernels cannot run, naming the module class and
    the argument."""
    module, num_heads, key, value, scale, kwargs = call
    kwargs, name = dict(kwargs), type(module).__name__
    if key.shape[-1] != value.shape[-1] or key.shape[1] != value.shape[1]:
        raise ValueError(
            f"{name}: keys {tuple(key.shape)} and values {tuple(value.shape)} differ in heads or "
            "head size; pagedq's paged cache keeps one page shape for both"
        )
    if kwargs.pop("attention_mask") is not None:
        raise ValueError(
            f"{name} builds an attention mask of its own: pagedq's paged attention is causal "
            "(and windowed) by the step's metadata alone"
        )
    if dropout := kwargs.pop("dropout"):
        raise ValueError(f"{name}: attention dropout={dropout} at inference is not supported")
    if kwargs.pop("is_causal", None) is False:
        raise ValueError(f"{name}: is_causal=False (bidirectional attention) is not supported")
    if kwargs.get("output_attentions"):
        raise ValueError(f"{name}: output_attentions=True is not supported")
    window = kwargs.pop("sliding_window", None)
    if window is not None and config_window is not None and int(window) != config_window:
        raise ValueError(
            f"{name} (layer {module.layer_idx}): sliding_window={window} differs from the "
            f"config's {config_window}"
        )
    softcap = kwargs.pop("softcap", None)
    sinks = [s for s in (kwargs.pop(k, None) for k in SINK_KWARGS) if s is not None]
    unknown = sorted(k for k, v in kwargs.items() if k not in IGNORED_KWARGS and v is not None)
    if unknown:
        raise ValueError(
            f"{name} passes {unknown} to its attention function: pagedq's paged attention "
            "does not run that option"
        )
    return LayerCall(
        module=module,
        num_heads=num_heads,
        num_kv_heads=key.shape[1],
        head_dim=key.shape[-1],
        scale=scale,
        sliding_window=config_window if window is None else int(window),
        logits_soft_cap=None if softcap is None else float(softcap),
        sinks=sinks[0] if sinks else None,
    )


def register() -> None:
    """Register ``paged_attention_forward`` as ``attn_implementation="pagedq"`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
