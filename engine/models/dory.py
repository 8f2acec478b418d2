"""Dory (``dory``, NVIDIA Nemotron-Labs Dory 1.0): an nGPT decoder (every hidden state projected
onto the unit sphere) whose middle layers run several times, a loop of ``n_recurrent_layers``
layers repeated ``n_recurrent_loops`` times between ``n_input_layers`` and ``n_output_layers``.

- Blocks: L2-normalized input; attention whose queries and keys are L2-normalized per head,
  queries rescaled per channel by ``(sqk * sqk_scale) ** 2`` after RoPE, the output gated by
  ``sigmoid(gate_proj(x) * (s_gate * s_gate_scale) ** 2)`` and L2-normalized before ``o_proj``;
  a SwiGLU whose gate and up are scaled per channel (``suv``) and whose product is
  L2-normalized; each sublayer's normalized output interpolated into the stream at a learned
  per-channel rate (``|lambda * ngpt_alpha_init / initializer_range|``), not added.
- The loop: each pass starts from ``norm(h) + norm(h_in)``, ``h_in`` the stream after the input
  layers. Each pass keeps a KV cache of its own (``recurrent_kv_cache_mode="per_loop"``): the
  layers are unrolled into the engine's layer list, the looped modules shared, so every
  position of the unrolled list is a paged cache of its own.
- Sliding and full layers with a RoPE base per type; the logits scaled per token
  (``lm_head.logit_scale / initializer_range``).

One rank only: the output gate's norm spans every head.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import Attention, AttentionOptions
from engine.models.causal_lm import CausalLM
from engine.models.config_fields import head_dim_of
from engine.models.linear import MergedLinear
from engine.models.rotary import RotaryEmbedding
from engine.parallel.state import tp_size
from kernels import apply_rotary

SLIDING = "sliding_attention"
_LAYER = re.compile(r"^layers\.(\d+)\.")
_RELEASED_PAIR = re.compile(r"^layers\.(\d+)\.(mixer|attn_alpha|mlp_alpha)(?=\.|$)")


def _collapse_pair(match: re.Match) -> str:
    index, part = int(match[1]), match[2]
    part = {"attn_alpha": "lambda_1", "mlp_alpha": "lambda_2"}.get(
        part, ("self_attn", "mlp")[index % 2]
    )
    return f"layers.{index // 2}.{part}"


def l2_normalized(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x`` over its last dimension's Euclidean norm (fp32 inside, as transformers'
    ``DoryL2Norm``)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).type_as(x)


class DoryAttention(Attention):
    """Unit-norm queries and keys, per-channel query scales, a gated and normalized output."""

    def __init__(self, config, layer_type: str, max_position: int, backend: str) -> None:
        head_dim, heads = head_dim_of(config), config.num_attention_heads
        window = config.sliding_window if layer_type == SLIDING else None
        options = AttentionOptions(
            qkv_bias=bool(config.attention_bias), o_bias=bool(config.attention_bias),
            sliding_window=window if window and window < max_position else None,
        )  # fmt: skip
        super().__init__(
            config.hidden_size, heads, config.num_key_value_heads, head_dim, backend, options
        )
        self.out_gate = nn.Linear(config.hidden_size, heads * head_dim, bias=False)
        self.sqk = nn.Parameter(torch.zeros(heads * head_dim))
        self.s_gate = nn.Parameter(torch.zeros(heads * head_dim))
        self.sqk_scale = head_dim**0.5 / config.initializer_range
        self.s_gate_scale = config.hidden_size**0.25 / config.initializer_range

    def forward(self, rope, hidden, kv_cache, meta) -> torch.Tensor:
        tokens, heads, kv_heads, dim = (
            hidden.shape[0],
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )
        q, k, v = self.qkv_proj(hidden).split([heads * dim, kv_heads * dim, kv_heads * dim], 1)
        qk = torch.cat(
            (
                l2_normalized(q.view(tokens, heads, dim)),
                l2_normalized(k.view(tokens, kv_heads, dim)),
            ),
            dim=1,
        )
        qk = apply_rotary(qk, rope[0], rope[1], backend=self.backend)
        q = qk[:, :heads] * (self.sqk * self.sqk_scale).view(heads, dim).square()
        out = self.attn(q, qk[:, heads:], v.view(tokens, kv_heads, dim), kv_cache, meta)
        gate = self.out_gate(hidden) * (self.s_gate * self.s_gate_scale).square()
        out = out.reshape(tokens, heads * dim) * torch.sigmoid(gate)
        return self.o_proj(l2_normalized(out))


class DoryMLP(nn.Module):
    """``down(norm(silu(gate(x) * s_gate) * (up(x) * s_up)))``."""

    def __init__(self, config) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, bool(config.mlp_bias)
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported: Dory runs 'silu'")
        self.gate_up_proj = MergedLinear(hidden, {"gate": inter, "up": inter}, bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.suv_gate = nn.Parameter(torch.ones(inter))
        self.suv_up = nn.Parameter(torch.ones(inter))
        self.suv_scale = hidden**0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        gate = gate * (self.suv_gate * self.suv_scale)
        up = up * (self.suv_up * self.suv_scale)
        return self.down_proj(l2_normalized(F.silu(gate) * up))


class DoryDecoderLayer(nn.Module):
    """nGPT's block: normalized sublayer outputs interpolated into the normalized stream."""

    def __init__(self, config, layer_type: str, max_position: int, backend: str) -> None:
        super().__init__()
        self.self_attn = DoryAttention(config, layer_type, max_position, backend)
        self.mlp = DoryMLP(config)
        self.lambda_1 = nn.Parameter(torch.zeros(config.hidden_size))
        self.lambda_2 = nn.Parameter(torch.zeros(config.hidden_size))
        self.lambda_scale = config.ngpt_alpha_init / config.initializer_range

    def forward(self, rope, hidden, residual, kv_cache, meta):
        hidden = l2_normalized(hidden)
        attn = l2_normalized(self.self_attn(rope, hidden, kv_cache, meta))
        hidden = hidden + (self.lambda_1 * self.lambda_scale).abs() * (attn - hidden)
        hidden = l2_normalized(hidden)
        mlp = l2_normalized(self.mlp(hidden))
        return hidden + (self.lambda_2 * self.lambda_scale).abs() * (mlp - hidden), None


class DoryForCausalLM(CausalLM):
    """Dory's layers unrolled: input layers, the loop's layers once per pass (shared modules, a
    cache per pass), output layers."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        if tp_size() > 1:
            raise ValueError(
                "tensor_parallel_size > 1 is not supported for dory: its attention output's "
                "norm spans every head"
            )
        if config.recurrent_kv_cache_mode != "per_loop":
            raise ValueError(
                f"recurrent_kv_cache_mode={config.recurrent_kv_cache_mode!r} is not supported: "
                "pagedq keeps a cache per loop ('per_loop')"
            )
        super().__init__(config, max_position, backend)
        head_dim = head_dim_of(config)
        for layer_type in sorted(set(config.layer_types)):
            self.rotaries[layer_type] = RotaryEmbedding(
                config, head_dim, max_position, layer_type=layer_type
            )
        blocks = [
            DoryDecoderLayer(config, config.layer_types[i], max_position, backend)
            for i in range(config.num_hidden_layers)
        ]
        start, loop = config.n_input_layers, config.n_recurrent_layers
        loops = config.n_recurrent_loops
        order = list(range(start)) + list(range(start, start + loop)) * loops
        order += list(range(start + loop, config.num_hidden_layers))
        for i in order:
            blocks[i].rope_key = config.layer_types[i]
            self.layers.append(blocks[i])
        self.loop_starts = {start + n * loop for n in range(loops)} if loop else set()
        self.recurrent_start = start
        # Checkpoint index -> the first place of that layer in the unrolled list.
        self.output_shift = (loops - 1) * loop
        self.output_start = start + loop
        self.logit_scale = nn.Parameter(torch.zeros(config.vocab_size))
        self.logit_scale_factor = 1 / config.initializer_range

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        hidden = self.embed(input_ids, positions)
        ropes = {
            key: rotary.cos_sin(positions, hidden.dtype) for key, rotary in self.rotaries.items()
        }
        loop_input = None
        for i, (layer, kv_cache, layer_meta) in enumerate(zip(self.layers, kv_caches, meta)):
            if i == self.recurrent_start:
                loop_input = l2_normalized(hidden)
            if i in self.loop_starts:
                hidden = l2_normalized(hidden) + loop_input
            hidden, _ = layer(ropes[layer.rope_key], hidden, None, kv_cache, layer_meta)
        return l2_normalized(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        scale = self.logit_scale.float() * self.logit_scale_factor
        return super().compute_logits(hidden) * scale

    def greedy_token_ids(self, hidden: torch.Tensor) -> list[int] | None:
        return None  # a scale per token moves the argmax: logits first

    def checkpoint_name(self, name: str) -> str | None:
        if name == "lm_head.logit_scale":
            return "logit_scale"
        name = name.removeprefix("backbone.")
        if name.startswith("embeddings."):
            name = "embed_tokens." + name.removeprefix("embeddings.")
        # Released checkpoints: attention block i as layers.{2i}.mixer, its MLP as layers.{2i+1}.
        name = _RELEASED_PAIR.sub(_collapse_pair, name)
        name = re.sub(r"\.self_attn\.(g_proj|gate_proj)\.", ".self_attn.out_gate.", name)
        match = _LAYER.match(name)
        if match and int(match.group(1)) >= self.output_start:
            index = int(match.group(1)) + self.output_shift
            name = f"layers.{index}." + name[match.end() :]
        return super().checkpoint_name(name)
