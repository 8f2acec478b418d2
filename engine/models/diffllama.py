"""DiffLlama (``diffllama``): Llama with differential attention (arXiv 2410.05258). Each layer
attends twice with the same rotated q and k, once over the first half of the KV heads' values
and once over the second (each half repeated to every KV head); the query heads' outputs are
paired, first half against second, as ``out_a - lambda * out_b`` with
``lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init(layer)``, put
through a weightless RMSNorm over the pair's ``2 * head_dim`` features and scaled by
``1 - lambda_init``.

Both passes are one paged-attention call: the cache keeps ``[k | 0]`` and ``[v_first | v_second]``
per KV head (``2 * head_dim`` wide), so each head's output is ``[out_1 | out_2]`` at once.
Transformers' two interface calls per layer are what the backend cannot run."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import Attention
from engine.models.config_fields import head_dim_of, num_kv_heads_of
from engine.models.llama import LlamaForCausalLM
from engine.parallel.state import tp_size
from kernels import apply_rotary


def lambda_init(layer_idx: int) -> float:
    """The paper's depth schedule, ``0.8 - 0.6 * exp(-0.3 * layer)``."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


class DifferentialAttention(Attention):
    """Differential attention over a cache of ``2 * head_dim``-wide rows (``head_dim`` here is
    the cache's; ``qk_head_dim`` the projections')."""

    def __init__(self, config, layer_idx: int, options, backend: str) -> None:
        head_dim, kv_heads = head_dim_of(config), num_kv_heads_of(config)
        super().__init__(
            config.hidden_size, config.num_attention_heads, kv_heads, head_dim, backend, options
        )
        self.qk_head_dim, self.head_dim = head_dim, 2 * head_dim
        self.lambda_init = lambda_init(layer_idx)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, nn.Parameter(torch.zeros(head_dim)))
        self.norm_eps = config.rms_norm_eps

    def forward(self, rope, hidden, kv_cache, meta) -> torch.Tensor:
        tokens, heads, kv_heads, dim = (
            hidden.shape[0],
            self.num_heads,
            self.num_kv_heads,
            self.qk_head_dim,
        )
        q, k, v = self.qkv_proj(hidden).split([heads * dim, kv_heads * dim, kv_heads * dim], 1)
        qk = torch.cat((q, k), dim=1).view(tokens, heads + kv_heads, dim)
        qk = apply_rotary(qk, rope[0], rope[1], backend=self.backend)
        v = v.view(tokens, kv_heads, dim)
        half = kv_heads // 2
        first, second = v[:, :half], v[:, half:]
        values = torch.cat((first.repeat(1, 2, 1), second.repeat(1, 2, 1)), dim=-1)
        out = self.attn(
            F.pad(qk[:, :heads], (0, dim)), F.pad(qk[:, heads:], (0, dim)), values, kv_cache, meta
        )  # [tokens, heads, 2 * dim]: each head's [out_1 | out_2]
        out_a, out_b = out[:, : heads // 2], out[:, heads // 2 :]
        out = out_a - self._lambda(out.dtype) * out_b
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        out = (1 - self.lambda_init) * out
        return self.o_proj(out.reshape(tokens, heads * dim))

    def _lambda(self, dtype: torch.dtype) -> torch.Tensor:
        first = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dim=-1, dtype=torch.float32))
        second = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dim=-1, dtype=torch.float32))
        return first.to(dtype) - second.to(dtype) + self.lambda_init


class DiffLlamaForCausalLM(LlamaForCausalLM):
    """Llama's stack with differential attention."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        if tp_size() > 1:
            raise ValueError(
                "tensor_parallel_size > 1 is not supported for diffllama: its value halves and "
                "paired query heads span every rank's heads"
            )
        kv_heads = num_kv_heads_of(config)
        if kv_heads % 2:
            raise ValueError(f"num_key_value_heads={kv_heads} is not supported: must be even")
        super().__init__(config, max_position, backend)

    def make_attention(self, layer_idx: int) -> DifferentialAttention:
        return DifferentialAttention(
            self.config, layer_idx, self.attention_options(layer_idx), self.backend
        )
