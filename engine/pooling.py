"""Embeddings: a request that stops after its prefill and pools its hidden states.

`PoolingParams` is to an embedding request what `SamplingParams` is to a generation (vLLM's
name). The pooled vector is taken from the model's final hidden states (the final norm
applied, as Hugging Face's `last_hidden_state`), in float32:

- "last": the last prompt token's state (decoder embedding models: e5-mistral, Qwen3-Embedding);
- "mean": the mean over every prompt token (sentence-transformers' `pooling_mode_mean_tokens`);
- "cls": the first token's state.

Which one a checkpoint uses comes from its sentence-transformers files (`modules.json`, then
`1_Pooling/config.json`), else "last". Mean and CLS need every token computed by this request,
so such a request never takes blocks from the prefix cache; a chunked prefill adds its chunks
to a running sum.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

POOLING_TYPES = ("last", "mean", "cls")
# sentence-transformers' 1_Pooling/config.json flags, in the order it checks them.
_ST_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}


@dataclass(slots=True)
class PoolingParams:
    """How to turn a prompt's hidden states into one vector.

    ``pooling``: one of POOLING_TYPES, or None for the checkpoint's own. ``normalize``: divide
    by the L2 norm. ``dimensions``: keep the first this many (then normalize again), for
    Matryoshka-trained models; at most the hidden size.
    """

    pooling: str | None = None
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling={self.pooling!r} is invalid: must be one of {POOLING_TYPES}")
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool)
            or not isinstance(self.dimensions, int)
            or self.dimensions < 1
        ):
            raise ValueError(f"dimensions={self.dimensions!r} is invalid: must be an integer >= 1")

    @property
    def needs_every_token(self) -> bool:
        """Mean and CLS pooling read tokens a prefix-cache hit would skip."""
        return self.pooling != "last"


def checkpoint_pooling(folder: str | None) -> str:
    """The pooling a checkpoint folder declares (sentence-transformers files), else "last"."""
    if folder is None:
        return "last"
    root = Path(folder)
    pooling_dir = root / "1_Pooling"
    modules = root / "modules.json"
    if modules.exists():
        for module in json.loads(modules.read_text()):
            if str(module.get("type", "")).endswith("Pooling"):
                pooling_dir = root / module.get("path", "1_Pooling")
    config = pooling_dir / "config.json"
    if config.exists():
        flags = json.loads(config.read_text())
        for flag, pooling in _ST_MODES.items():
            if flags.get(flag):
                return pooling
    return "last"


class PoolingState:
    """What a pooling request has gathered so far over its prefill chunks."""

    __slots__ = ("params", "total", "embedding")

    def __init__(self, params: PoolingParams) -> None:
        self.params = params
        self.total: torch.Tensor | None = None  # the running sum (mean) or the first state
        self.embedding: list[float] | None = None

    def add_chunk(self, hidden: torch.Tensor, start: int, num_tokens: int) -> None:
        """Take the final hidden states ``[n, hidden]`` of prompt positions [start, start+n)."""
        if start == 0:  # a first chunk, or a recompute after a preemption: start over
            self.total = None
        states = hidden.float()
        pooling = self.params.pooling
        if pooling == "mean":
            chunk_sum = states.sum(0)
            self.total = chunk_sum if self.total is None else self.total + chunk_sum
        elif pooling == "cls" and start == 0:
            self.total = states[0].clone()
        if start + states.shape[0] < num_tokens:
            return
        if pooling == "mean":
            vector = self.total / num_tokens
        elif pooling == "cls":
            vector = self.total
        else:
            vector = states[-1]
        self.embedding = finish_vector(vector, self.params).tolist()


def finish_vector(vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Cut to ``dimensions`` and L2-normalize, as asked."""
    if params.dimensions is not None:
        if params.dimensions > vector.shape[-1]:
            raise ValueError(
                f"dimensions={params.dimensions} is invalid: must be <= the model's hidden "
                f"size {vector.shape[-1]}"
            )
        vector = vector[..., : params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, p=2, dim=-1)
    return vector
