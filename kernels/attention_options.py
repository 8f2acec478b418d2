"""The options of paged attention that today's models need, checked once for every backend.

- ``sliding_window`` W: query position q sees key positions q - W < k <= q (Hugging Face's
  ``sliding_window_overlay``: Mistral, Gemma 2/3, gpt-oss, OLMo 3); None: all of 0..q.
- ``sinks`` ``[num_heads]``: a learned logit per query head that joins the softmax denominator
  with no value (gpt-oss), in natural-log units like the scores; None: no sink.
- ``logits_soft_cap`` c: scores become ``c * tanh(scores / c)`` before the mask (Gemma 2);
  None: no cap.
- ``alibi_slopes`` ``[num_heads]``: ALiBi (BLOOM, MPT): each query head's score of key
  position k from query position q gains ``slope * (k - q)`` after the scale (and any cap);
  None: no bias. (Hugging Face adds ``slope * k``: the same softmax, as each row's shift is
  constant; not with a sink, whose logit is absolute, so the two are not taken together.)

None everywhere is plain causal attention, the path every backend had before these options.
"""

from __future__ import annotations

import math

import torch


def check_options(
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    logits_soft_cap: float | None,
    num_heads: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> None:
    """Raise ``ValueError`` naming the bad option, its value and what is allowed."""
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if logits_soft_cap is not None and (
        isinstance(logits_soft_cap, bool)
        or not isinstance(logits_soft_cap, (int, float))
        or not math.isfinite(logits_soft_cap)
        or logits_soft_cap <= 0
    ):
        raise ValueError(
            f"logits_soft_cap must be None or a finite number > 0, got {logits_soft_cap!r}"
        )
    for name, per_head, unit in (
        ("sinks", sinks, "logit"),
        ("alibi_slopes", alibi_slopes, "slope"),
    ):
        if per_head is None:
            continue
        if not isinstance(per_head, torch.Tensor) or per_head.dim() != 1:
            shape = tuple(per_head.shape) if isinstance(per_head, torch.Tensor) else type(per_head)
            raise ValueError(f"{name} must be None or a 1-D tensor [num_heads], got {shape}")
        if num_heads is not None and per_head.shape[0] != num_heads:
            raise ValueError(
                f"{name} must have one {unit} per query head ({num_heads}), got {per_head.shape[0]}"
            )
        if not per_head.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {per_head.dtype}")
    if sinks is not None and alibi_slopes is not None:
        # The kernels add slope * (k - q): the softmax of HF's slope * k, save against a sink.
        raise ValueError("sinks and alibi_slopes cannot be set together: no model has both")


def has_options(
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    logits_soft_cap: float | None,
    alibi_slopes: torch.Tensor | None = None,
) -> bool:
    """True when any option is set (not plain causal attention)."""
    return (
        sliding_window is not None
        or sinks is not None
        or logits_soft_cap is not None
        or alibi_slopes is not None
    )
