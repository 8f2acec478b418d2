"""Linear layers whose checkpoint weights arrive in several pieces (q/k/v, gate/up)."""

from __future__ import annotations

import torch
from torch import nn


class KeepsPackedDtypes(nn.Module):
    """A module whose parameters marked ``keep_dtype`` (packed quantized weights, their fp32
    scales) keep their dtype when the model is cast to bf16 (which would round the scales);
    they still move between devices with it."""

    def _apply(self, fn, recurse=True):
        def move_only(t: torch.Tensor) -> torch.Tensor:
            if getattr(t, "keep_dtype", False):
                return t.to(fn(t.new_empty(0)).device)
            return fn(t)

        return super()._apply(move_only, recurse)


class MergedLinear(nn.Linear):
    """One linear made of named output shards, e.g. ``qkv_proj`` of ``q_proj``, ``k_proj``,
    ``v_proj``: one GEMM a step instead of three. A checkpoint may bring each shard on its own
    (Llama) or the merged weight whole (Phi-3); ``load_weights`` accepts either."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size
        for param in self.parameters():
            param.weight_loader = self._load_shard
            param.expected_shards = set(shard_sizes)

    def _load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard: str | None) -> None:
        if shard is None:  # the merged weight, whole
            param.data.copy_(tensor)
            return
        offset, size = self.shard_offsets[shard]
        param.data[offset : offset + size].copy_(tensor)


def load_param(param: nn.Parameter, tensor: torch.Tensor, shard, name: str) -> None:
    """Copy ``tensor`` (checkpoint name ``name``) into ``param`` (or the ``shard`` of it),
    through the parameter's own ``weight_loader`` where it has one; refuses a shape that does
    not match, naming the tensor."""
    loader = getattr(param, "weight_loader", None)
    checkpoint_shape = getattr(param, "checkpoint_shape", None)  # a rank's slice of it
    if checkpoint_shape is not None:
        expected = tuple(checkpoint_shape(shard))
    elif shard is not None:
        expected = _shard_shape(param, shard)
    else:
        expected = tuple(param.shape)
    if tuple(tensor.shape) != expected:
        raise ValueError(
            f"weight {name!r}: shape {tuple(tensor.shape)} does not match the config, "
            f"expected {expected}"
        )
    if loader is not None:
        loader(param, tensor, shard)
    else:
        param.data.copy_(tensor)


def _shard_shape(param: nn.Parameter, shard) -> tuple[int, ...]:
    shape = getattr(param, "shard_shape", None)
    if shape is not None:
        return tuple(shape(shard))
    owner = param.weight_loader.__self__
    return (owner.shard_offsets[shard][1], *param.shape[1:])


def linear_fp32_out(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` as fp32 sums of the inputs' products, not rounded to their dtype:
    a bf16 model's logits (LM head, MoE routers) as fp32 accumulation gives them (CUDA: one GEMM
    with an fp32 output; elsewhere the operands widened, exactly)."""
    if x.dtype == weight.dtype == torch.float32:
        return torch.nn.functional.linear(x, weight, bias)
    bias = None if bias is None else bias.float()
    if x.is_cuda and x.dtype == weight.dtype:
        try:
            out = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
            out = out.view(*x.shape[:-1], weight.shape[0])
            return out if bias is None else out + bias
        except (RuntimeError, TypeError):  # a torch without mm's out_dtype for this dtype
            pass
    return torch.nn.functional.linear(x.float(), weight.float(), bias)
