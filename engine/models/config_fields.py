"""Fields of a Hugging Face config that families read the same way."""

from __future__ import annotations


def head_dim_of(config) -> int:
    """The config's head size (``head_dim`` where it says, else hidden / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config) -> int:
    """The config's key/value head count (GQA), defaulting to the query heads."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def layer_type_of(config, layer_idx: int) -> str:
    """ "sliding_attention" or "full_attention" (``config.layer_types`` where it has them)."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[layer_idx]
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def layer_sliding_window(config, layer_idx: int, max_position: int) -> int | None:
    """The window layer ``layer_idx`` attends within, or None for full attention. A window no
    shorter than ``max_position`` is no window: no context can outgrow it."""
    window = getattr(config, "sliding_window", None)
    if window is None or layer_type_of(config, layer_idx) != "sliding_attention":
        return None
    return int(window) if int(window) < max_position else None


def max_position_of(config) -> int:
    """The longest sequence the model runs: ``max_position_embeddings``, stretched by the
    factor of a dynamic RoPE (which rescales its frequencies past that length, as vLLM
    counts it)."""
    from engine.models.rotary import rope_parameters

    max_position = int(getattr(config, "max_position_embeddings", None) or 8192)
    params = rope_parameters(config)
    if params.get("rope_type") == "dynamic":
        max_position = int(max_position * float(params.get("factor", 1.0)))
    return max_position
