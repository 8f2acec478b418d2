"""Layers sharded over the tensor-parallel ranks (after Megatron's and nano-vllm's): each rank
holds its slice of the weight and loads it from the whole checkpoint tensor through the
parameter's ``weight_loader``, so no rank ever holds a whole matrix.

- ``ColumnParallelLinear``: output features split; no communication.
- ``MergedColumnParallelLinear``: named output shards (gate and up), each split.
- ``QKVParallelLinear``: q heads split; KV heads split, or replicated where there are fewer KV
  heads than ranks (each rank keeps the KV head its q heads read).
- ``RowParallelLinear``: input features split; one all-reduce, the bias added once after it.
- ``VocabParallelEmbedding``: rows split; each rank looks up its own ids, one all-reduce.
- ``ParallelLMHead``: rows split; the logits gathered along the vocabulary.

At one rank each is the plain layer (same parameters, same numbers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel.state import all_gather_last, all_reduce, divide, tp_rank, tp_size


def _checkpoint_shape(param: nn.Parameter, shape) -> None:
    param.checkpoint_shape = shape  # what load_param checks the checkpoint tensor against


class ColumnParallelLinear(nn.Linear):
    """``y = x @ W.T + b`` with this rank's ``out_features / N`` rows of ``W`` (and of ``b``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.full_out = out_features
        super().__init__(in_features, divide(out_features, tp_size(), "out_features"), bias)
        for param in self.parameters():
            param.weight_loader = self._load
            _checkpoint_shape(param, lambda shard, p=param: (self.full_out, *p.shape[1:]))

    def _load(self, param: nn.Parameter, tensor: torch.Tensor, shard) -> None:
        rows = param.shape[0]
        param.data.copy_(tensor.narrow(0, tp_rank() * rows, rows))


class MergedColumnParallelLinear(nn.Linear):
    """One column-parallel GEMM of named output shards (``{"gate": I, "up": I}``): each rank
    holds its slice of every shard, side by side, and loads each checkpoint shard alone (or the
    merged checkpoint tensor, whole: Phi-3's ``gate_up_proj``)."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        n = tp_size()
        self.full_sizes = dict(shard_sizes)
        local = {name: divide(size, n, f"{name} size") for name, size in shard_sizes.items()}
        super().__init__(in_features, sum(local.values()), bias)
        self.shard_offsets, offset = {}, 0
        for name, size in local.items():
            self.shard_offsets[name] = (offset, size)
            offset += size
        _shard_loaders(self, self.full_sizes)

    def _load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard: str | None) -> None:
        if shard is None:
            return _load_whole(self, param, tensor)
        offset, size = self.shard_offsets[shard]
        param.data[offset : offset + size].copy_(tensor.narrow(0, tp_rank() * size, size))


class QKVParallelLinear(nn.Linear):
    """q, k and v projections in one GEMM, split by heads: this rank's ``heads / N`` q heads and
    ``max(1, kv_heads / N)`` KV heads (a KV head replicated on ``N / kv_heads`` ranks when
    there are fewer KV heads than ranks). ``q_head_dim``: a q head's rows where they are more
    than ``head_dim`` (Qwen3.5's output gate: ``[q_h, gate_h]`` per head); ``v_head_dim``: a v
    head's where values are narrower than keys (MiMo-V2-Flash)."""

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
        bias: bool = False, q_head_dim: int | None = None, v_head_dim: int | None = None,
    ) -> None:  # fmt: skip
        n, rank = tp_size(), tp_rank()
        self.num_heads = divide(num_heads, n, "num_attention_heads")
        if num_kv_heads >= n:
            self.num_kv_heads = divide(num_kv_heads, n, "num_key_value_heads")
            self.kv_head0 = rank * self.num_kv_heads
        else:
            divide(n, num_kv_heads, "tensor_parallel_size over num_key_value_heads")
            self.num_kv_heads, self.kv_head0 = 1, rank * num_kv_heads // n
        self.head_dim, self.q_head_dim = head_dim, q_head_dim or head_dim
        self.v_head_dim = v_head_dim or head_dim
        q, k = self.num_heads * self.q_head_dim, self.num_kv_heads * head_dim
        v = self.num_kv_heads * self.v_head_dim
        super().__init__(hidden_size, q + k + v, bias)
        self.shard_offsets = {"q": (0, q), "k": (q, k), "v": (q + k, v)}
        self.full_sizes = {
            "q": num_heads * self.q_head_dim,
            "k": num_kv_heads * head_dim,
            "v": num_kv_heads * self.v_head_dim,
        }
        _shard_loaders(self, self.full_sizes)

    def _load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard: str | None) -> None:
        if shard is None:
            return _load_whole(self, param, tensor)
        offset, size = self.shard_offsets[shard]
        if shard == "q":
            start = tp_rank() * self.num_heads * self.q_head_dim
        else:
            start = self.kv_head0 * (self.v_head_dim if shard == "v" else self.head_dim)
        param.data[offset : offset + size].copy_(tensor.narrow(0, start, size))


def _shard_loaders(layer: nn.Linear, full_sizes: dict[str, int]) -> None:
    """Every parameter of a layer of named output shards loads through ``layer._load_shard``,
    checked against the whole checkpoint shard (or all shards merged, for ``shard=None``)."""

    def full(shard: str | None) -> int:
        return sum(full_sizes.values()) if shard is None else full_sizes[shard]

    for param in layer.parameters():
        param.weight_loader = layer._load_shard
        param.expected_shards = set(full_sizes)
        _checkpoint_shape(param, lambda shard, p=param: (full(shard), *p.shape[1:]))


def _load_whole(layer: nn.Linear, param: nn.Parameter, tensor: torch.Tensor) -> None:
    """The merged checkpoint tensor, whole: each named shard's rows loaded as that shard."""
    for name, part in zip(layer.full_sizes, tensor.split(list(layer.full_sizes.values()))):
        layer._load_shard(param, part, name)


class RowParallelLinear(nn.Linear):
    """``y = x @ W.T + b`` with ``x`` split along its features (a column-parallel layer's
    output): this rank's ``in_features / N`` columns of ``W``, then one all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.full_in = in_features
        super().__init__(divide(in_features, tp_size(), "in_features"), out_features, bias)
        self.weight.weight_loader = self._load_weight
        _checkpoint_shape(self.weight, lambda shard: (self.weight.shape[0], self.full_in))

    def _load_weight(self, param: nn.Parameter, tensor: torch.Tensor, shard) -> None:
        cols = param.shape[1]
        param.data.copy_(tensor.narrow(1, tp_rank() * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.linear(x, self.weight, self.bias)
        y = all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """This rank's ``ceil(vocab / N)`` rows of the table; ids of other ranks look up zeros,
    and one all-reduce sums the ranks' rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        self.full_vocab = num_embeddings
        self.rows = -(-num_embeddings // tp_size())
        self.row0 = tp_rank() * self.rows
        super().__init__(self.rows, embedding_dim)
        self.weight.weight_loader = self._load
        _checkpoint_shape(self.weight, lambda shard: (self.full_vocab, embedding_dim))

    def _load(self, param: nn.Parameter, tensor: torch.Tensor, shard) -> None:
        rows = max(0, min(self.rows, self.full_vocab - self.row0))
        param.data.zero_()
        param.data[:rows].copy_(tensor.narrow(0, self.row0, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.row0
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside[..., None], 0))


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head over this rank's vocabulary rows; ``logits`` gathers every rank's columns."""

    bias = None  # a linear layer's view of it (prepacking reads ``weight`` and ``bias``)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[rows, vocab]`` (every rank gets them all)."""
        return gathered_logits(hidden, self.weight, self.full_vocab)


def gathered_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 logits over a vocabulary-parallel table (``weight``: this rank's rows), every
    rank's columns side by side: fp32 sums of the model dtype's products."""
    from engine.models.linear import linear_fp32_out

    logits = linear_fp32_out(hidden, weight)
    if tp_size() > 1:
        logits = all_gather_last(logits)[..., :vocab]
    return logits
