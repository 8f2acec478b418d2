"""OLMo Hybrid (``olmo_hybrid``): Gated DeltaNet layers (``qwen3_5.py``'s, with separate q, k,
v, gate, a and b projections, beta times 2 where ``linear_allow_neg_eigval``, an output norm of
eps 1e-5) in pre-norm blocks, beside OLMo 3's attention layers (norms after attention and the
MLP, QK-norm over the whole projections; RoPE where the config has a ``rope_theta``, else none)
in post-norm blocks; SwiGLU MLPs everywhere."""

from __future__ import annotations

from engine.models.attention import Attention, AttentionOptions
from engine.models.causal_lm import PACKED_MODULES, CausalLM
from engine.models.config_fields import head_dim_of, num_kv_heads_of
from engine.models.decoder import DecoderLayer
from engine.models.hybrid import HybridLayers
from engine.models.mlp import GatedMLP
from engine.models.qwen3_5 import LINEAR, GatedDeltaNet
from engine.models.rotary import RotaryEmbedding, rope_parameters

# A linear layer's checkpoint names -> ours (its own q/k/v_proj, not attention's).
_LINEAR_RENAMES = [
    (f".linear_attn.{theirs}.", f".self_attn.{ours}.")
    for theirs, ours in (
        ("q_proj", "in_proj_q"), ("k_proj", "in_proj_k"), ("v_proj", "in_proj_v"),
        ("g_proj", "in_proj_z"), ("a_proj", "in_proj_a"), ("b_proj", "in_proj_b"),
        ("o_proj", "out_proj"), ("o_norm", "norm"), ("q_conv1d", "conv1d_q"),
        ("k_conv1d", "conv1d_k"), ("v_conv1d", "conv1d_v"),
    )
] + [(".linear_attn.", ".self_attn.")]  # fmt: skip
# Released checkpoints' block norms -> transformers' (and ours): a linear layer's are pre-norms.
_NORM_RENAMES = [
    (".attention_layer_norm.", ".input_layernorm."),
    (".feedforward_layer_norm.", ".post_attention_layernorm."),
]
OUTPUT_NORM_EPS = 1e-5  # OlmoHybridGatedDeltaNet's o_norm, whatever rms_norm_eps says


class OlmoHybridForCausalLM(HybridLayers, CausalLM):
    """OLMo Hybrid's stack: Gated DeltaNet and OLMo 3 attention layers, a final norm."""

    packed_modules = {
        **PACKED_MODULES,
        **{f"in_proj_{p}": ("in_proj", p) for p in ("q", "k", "v", "z", "a", "b")},
        **{f"conv1d_{p}": ("conv1d", p) for p in "qkv"},
    }

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        head_dim = head_dim_of(config)
        has_rope = rope_parameters(config).get("rope_theta") is not None and bool(
            getattr(config, "rope_parameters", None)
        )
        if has_rope:
            self.rotaries["default"] = RotaryEmbedding(config, head_dim, max_position)
        beta_scale = 2.0 if config.linear_allow_neg_eigval else 1.0
        self.key_dim = config.linear_num_key_heads * config.linear_key_head_dim
        self.value_dim = config.linear_num_value_heads * config.linear_value_head_dim
        for layer_type in config.layer_types:
            mlp = GatedMLP(hidden, config.intermediate_size, backend)
            if layer_type == LINEAR:
                mixer = GatedDeltaNet(
                    config, backend, projections="separate", beta_scale=beta_scale,
                    norm_eps=OUTPUT_NORM_EPS,
                )  # fmt: skip
                layer = DecoderLayer(mixer, mlp, hidden, eps, backend)
                layer.rope_key = None
            else:
                mixer = Attention(
                    hidden, config.num_attention_heads, num_kv_heads_of(config), head_dim,
                    backend, AttentionOptions(qk_norm="proj", norm_eps=eps),
                )  # fmt: skip
                layer = DecoderLayer(mixer, mlp, hidden, eps, backend, norm_style="post")
                layer.rope_key = "default" if has_rope else None
            self.layers.append(layer)
        self.norm = self.make_norm()

    def load_weights(self, weights) -> None:
        """transformers 5's layout keeps a linear layer's three convs in one tensor: split it
        into the released checkpoints' ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``."""
        key, value = self.key_dim, self.value_dim

        def split(weights):
            for name, tensor in weights:
                if name.endswith(".linear_attn.conv1d.weight"):
                    parts = tensor.split([key, key, value])
                    for part, tensor_part in zip("qkv", parts, strict=True):
                        yield name.replace(".conv1d.", f".{part}_conv1d."), tensor_part
                else:
                    yield name, tensor

        super().load_weights(split(weights))

    def checkpoint_name(self, name: str) -> str | None:
        for theirs, ours in _LINEAR_RENAMES + _NORM_RENAMES:
            name = name.replace(theirs, ours, 1)
        return super().checkpoint_name(name)
