"""Gemma 3n (``gemma3n_text``, E2B / E4B; the ``gemma3n`` multimodal folders serve it): Gemma 4's
attention (QK-norm, a scale-free V-norm, softmax scale 1, KV shared by the last
``num_kv_shared_layers`` layers) and per-layer input embeddings, inside

- AltUp: ``altup_num_inputs`` streams of the hidden state (the embeddings and projections of
  them scaled to their magnitude); each layer predicts every stream from all of them (per-token
  coefficients from a tanh router), runs its block on the active one, and corrects every
  stream by the block's innovation; at the end the streams are projected back, rescaled and
  averaged;
- LAuReL: a low-rank residual beside attention, ``(attn + laurel) / sqrt(2)``;
- activation sparsity in the first layers' MLPs: the gate's values below a Gaussian quantile of
  its own row (``activation_sparsity_pattern``) set to zero before GeLU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.causal_lm import CausalLM
from engine.models.gemma4 import Gemma4Attention, is_unused_kv_weight, share_kv
from engine.models.linear import MergedLinear
from engine.models.norm import RMSNorm
from engine.models.rotary import RotaryEmbedding


class SparseGeluMLP(nn.Module):
    """GeGLU (tanh GeLU) whose gate keeps only the values above ``mean + std * icdf(s)`` of its
    row when the layer's sparsity ``s`` is above 0."""

    def __init__(self, hidden_size: int, intermediate_size: int, sparsity: float) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(
            hidden_size, {"gate": intermediate_size, "up": intermediate_size}, False
        )
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.sparsity = sparsity
        # The standard normal's quantile in fp32, as transformers computes it.
        normal = torch.distributions.normal.Normal(0, 1)
        self.std_multiplier = normal.icdf(torch.tensor(sparsity, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.sparsity > 0.0:
            multiplier = self.std_multiplier.to(gate.dtype)
            mean = gate.mean(dim=-1, keepdim=True)
            std = gate.std(dim=-1, keepdim=True, unbiased=False)
            gate = F.relu(gate - (mean + std * multiplier))
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class AltUp(nn.Module):
    """The streams' prediction before a layer and correction after it."""

    def __init__(self, config, backend: str) -> None:
        super().__init__()
        n, hidden = config.altup_num_inputs, config.hidden_size
        self.n, self.active = n, config.altup_active_idx
        self.correct_output_scale = nn.Parameter(torch.zeros(hidden))
        self.correction_coefs = nn.Linear(n, n, bias=False)
        self.prediction_coefs = nn.Linear(n, n * n, bias=False)
        self.modality_router = nn.Linear(hidden, n, bias=False)
        self.router_norm = RMSNorm(hidden, config.rms_norm_eps, backend)
        for module in (self.correction_coefs, self.prediction_coefs, self.modality_router):
            module.no_prepack = True  # a few columns: the plain GEMM is as fast

    def _modalities(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.modality_router(self.router_norm(x) * x.shape[-1] ** -1.0)
        return torch.tanh(routed.float()).type_as(x)

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        """``streams`` ``[n, T, H]``: each stream plus a per-token mix of all of them."""
        coefs = self.prediction_coefs(self._modalities(streams[self.active]))
        coefs = coefs.view(-1, self.n, self.n).transpose(1, 2)  # [T, n_in, n_out]
        mixed = torch.matmul(streams.permute(1, 2, 0), coefs)  # [T, H, n_out]
        return (mixed.permute(2, 0, 1) + streams).type_as(streams)

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """Every stream moved by its share of the active stream's innovation."""
        coefs = self.correction_coefs(self._modalities(activated)) + 1.0  # [T, n]
        innovation = activated - predictions[self.active]
        corrected = innovation[None] * coefs.permute(1, 0)[..., None] + predictions
        return corrected.type_as(activated)


class Gemma3nDecoderLayer(nn.Module):
    """One layer over the AltUp streams (``[n, T, H]`` in, ``[n, T, H]`` out)."""

    def __init__(self, config, layer_idx: int, max_position: int, backend: str) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps

        def norm() -> RMSNorm:
            return RMSNorm(hidden, eps, backend)

        self.self_attn = Gemma4Attention(config, layer_idx, max_position, backend)
        self.mlp = SparseGeluMLP(
            hidden, config.intermediate_size[layer_idx],
            config.activation_sparsity_pattern[layer_idx],
        )  # fmt: skip
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.altup = AltUp(config, backend)
        self.laurel = nn.Module()
        self.laurel.linear_left = nn.Linear(hidden, config.laurel_rank, bias=False)
        self.laurel.linear_right = nn.Linear(config.laurel_rank, hidden, bias=False)
        self.laurel.post_laurel_norm = norm()
        size = config.hidden_size_per_layer_input
        self.per_layer_input_gate = nn.Linear(hidden, size, bias=False)
        self.per_layer_projection = nn.Linear(size, hidden, bias=False)
        self.post_per_layer_input_norm = norm()
        self.correct_scale = config.altup_correct_scale

    def forward(self, rope, streams, per_layer_input, kv_cache, meta) -> torch.Tensor:
        predictions = self.altup.predict(streams)
        active = predictions[self.altup.active]
        normed = self.input_layernorm(active)
        laurel = self.laurel
        laurel_out = normed + laurel.post_laurel_norm(
            laurel.linear_right(laurel.linear_left(normed))
        )
        attn = self.post_attention_layernorm(self.self_attn(rope, normed, kv_cache, meta))
        attn_laurel = (active + attn + laurel_out) / math.sqrt(2)
        mlp = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(attn_laurel)))
        corrected = self.altup.correct(predictions, attn_laurel + mlp)
        first = corrected[self.altup.active]
        if self.correct_scale:
            first = (first * self.altup.correct_output_scale).type_as(first)
        first = F.gelu(self.per_layer_input_gate(first), approximate="tanh") * per_layer_input
        first = self.post_per_layer_input_norm(self.per_layer_projection(first))
        return torch.cat((corrected[:1], corrected[1:] + first), dim=0)


def _rescaled(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``x`` scaled to the root-mean-square ``target``."""
    magnitude = torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True).clamp(min=1e-5))
    return x * target / magnitude


class Gemma3nForCausalLM(CausalLM):
    """Gemma 3n's text model."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        hidden, layers = config.hidden_size, config.num_hidden_layers
        self.embed_scale = hidden**0.5
        self.final_logit_softcapping = config.final_logit_softcapping
        for layer_type in sorted(set(config.layer_types)):
            self.rotaries[layer_type] = RotaryEmbedding(
                config, config.head_dim, max_position, layer_type=layer_type
            )
        for i in range(layers):
            layer = Gemma3nDecoderLayer(config, i, max_position, backend)
            layer.rope_key = config.layer_types[i]
            share_kv(layer, config, i)
            self.layers.append(layer)
        self.norm = self.make_norm()
        self.per_layer_size = size = config.hidden_size_per_layer_input
        self.embed_tokens_per_layer = nn.Embedding(config.vocab_size_per_layer_input, layers * size)
        self.per_layer_model_projection = nn.Linear(hidden, layers * size, bias=False)
        self.per_layer_projection_norm = RMSNorm(size, config.rms_norm_eps, backend)
        count = config.altup_num_inputs - 1
        self.altup_projections = nn.ModuleList(
            nn.Linear(hidden, hidden, bias=False) for _ in range(count)
        )
        self.altup_unembed_projections = nn.ModuleList(
            nn.Linear(hidden, hidden, bias=False) for _ in range(count)
        )

    def per_layer_inputs(self, input_ids, embeds) -> torch.Tensor:
        """``[num_tokens, num_layers, size]``: each layer's input, from the token's row of the
        per-layer table (ids past it read row 0) and a projection of its embedding."""
        num_tokens, size = input_ids.shape[0], self.per_layer_size
        in_table = (input_ids >= 0) & (input_ids < self.config.vocab_size_per_layer_input)
        table = self.embed_tokens_per_layer(torch.where(in_table, input_ids, 0))
        table = table * torch.tensor(size**0.5, dtype=table.dtype)
        projected = self.per_layer_model_projection(embeds)
        projected = projected * torch.tensor(self.config.hidden_size**-0.5, dtype=embeds.dtype)
        projected = self.per_layer_projection_norm(projected.view(num_tokens, -1, size))
        scale = torch.tensor(2.0**-0.5, dtype=embeds.dtype)
        return (projected + table.view(num_tokens, -1, size)) * scale

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        per_layer = self.per_layer_inputs(input_ids, hidden)
        target = torch.mean(hidden**2, dim=-1, keepdim=True) ** 0.5
        streams = [hidden] + [_rescaled(p(hidden), target) for p in self.altup_projections]
        streams = torch.stack(streams)
        ropes = {key: r.cos_sin(positions, hidden.dtype) for key, r in self.rotaries.items()}
        for i, layer in enumerate(self.layers):
            streams = layer(ropes[layer.rope_key], streams, per_layer[:, i], kv_caches[i], meta[i])
        target = torch.mean(streams[0] ** 2, dim=-1, keepdim=True) ** 0.5
        unembedded = [streams[0]] + [
            _rescaled(p(s), target) for p, s in zip(self.altup_unembed_projections, streams[1:])
        ]
        return self.norm(torch.stack(unembedded).mean(dim=0))

    def checkpoint_name(self, name: str) -> str | None:
        return None if is_unused_kv_weight(self.layers, name) else super().checkpoint_name(name)
