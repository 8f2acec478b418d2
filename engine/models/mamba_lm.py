"""Mamba-1 language models: ``mamba`` (the state-spaces series) and ``falcon_mamba`` (TII's
Falcon Mamba, whose mixer RMS-normalises the time step, ``B`` and ``C`` without weights). The
stack is Mamba-2's (``mamba2_lm.py``: ``x + mixer(norm(x))``, the residual stream in fp32, no
attention, one block table that counts tokens) on the Mamba-1 mixer (``mamba1.py``)."""

from __future__ import annotations

from torch import nn

from engine.models.mamba1 import MambaMixer
from engine.models.mamba2_lm import Mamba2ForCausalLM


class MambaForCausalLM(Mamba2ForCausalLM):
    """A stack of Mamba-1 blocks, ``norm_f`` and the LM head."""

    bcdt_norm: str | None = None

    def make_mixer(self, config, backend: str) -> nn.Module:
        """One block's Mamba-1 mixer."""
        return MambaMixer(
            config.hidden_size, config.intermediate_size, config.state_size, config.conv_kernel,
            int(config.time_step_rank), backend, conv_bias=bool(config.use_conv_bias),
            proj_bias=bool(config.use_bias), bcdt_norm=self.bcdt_norm,
            norm_eps=float(getattr(config, "mixer_rms_eps", 1e-6)),
        )  # fmt: skip


class FalconMambaForCausalLM(MambaForCausalLM):
    """Mamba-1 with the time step, ``B`` and ``C`` RMS-normalised (``mixer_rms_eps``)."""

    bcdt_norm = "weightless"
