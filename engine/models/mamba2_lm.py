"""Mamba-2 language models (``mamba2``: Mamba-Codestral, the state-spaces Mamba-2 series): every
layer ``x + mixer(norm(x))`` with the Mamba-2 mixer (``mamba2.py``: grouped gated RMSNorm,
``time_step_limit``), the residual stream in fp32 (``residual_in_fp32``), no attention and no
MLP. Each sequence keeps only its state slots; the engine's block table is a token count
(``TokenBlocksSpec``), so batching, chunked prefill, preemption and prefix-cache snapshots run as
they do for the hybrids."""

from __future__ import annotations

from torch import nn

from engine.kv_cache_spec import TokenBlocksSpec
from engine.models.causal_lm import CausalLM
from engine.models.hybrid import HybridLayers
from engine.models.mamba2 import Mamba2Mixer, backbone_name
from engine.models.nemotron_h import NemotronHBlock
from engine.models.norm import RMSNorm


class Mamba2ForCausalLM(HybridLayers, CausalLM):
    """A stack of Mamba-2 blocks, its final norm (``norm_f``) and the LM head; ``make_mixer``
    gives each block's mixer (Mamba-1's LMs build the same stack on their own mixer)."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported: must be 'silu'")
        if not config.residual_in_fp32:
            raise ValueError("residual_in_fp32=False is not supported: must be True")
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        for _ in range(config.num_hidden_layers):
            mixer = self.make_mixer(config, backend)
            self.layers.append(NemotronHBlock(mixer, True, hidden, eps, backend))
        self.norm = RMSNorm(hidden, eps, backend)

    def make_mixer(self, config, backend: str) -> nn.Module:
        """One block's Mamba-2 mixer."""
        hidden = config.hidden_size
        if config.num_heads * config.head_dim != int(config.expand * hidden):
            raise ValueError(
                f"num_heads * head_dim = {config.num_heads * config.head_dim} must equal "
                f"expand * hidden_size = {int(config.expand * hidden)}"
            )
        return Mamba2Mixer(
            hidden, config.num_heads, config.head_dim, config.n_groups, config.state_size,
            config.conv_kernel, config.layer_norm_epsilon, backend,
            conv_bias=bool(config.use_conv_bias), proj_bias=bool(config.use_bias),
            time_step_limit=tuple(config.time_step_limit),
        )  # fmt: skip

    def kv_cache_specs(self) -> list[TokenBlocksSpec]:
        """No layer has paged KV: one block table that counts tokens."""
        return [TokenBlocksSpec()]

    def checkpoint_name(self, name: str) -> str | None:
        """Mamba-2's names (``backbone.``) -> ours."""
        name = backbone_name(name)
        return super().checkpoint_name(name.replace(".mixer.", ".self_attn.", 1))
