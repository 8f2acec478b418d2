"""pagedq's fused MoE kernels as a transformers experts implementation (``ExpertsInterface``).

transformers 5 keeps a family's experts as 3-D tensors (``gate_up_proj`` ``[E, 2I, H]``, gate
rows then up rows; ``down_proj`` ``[E, H, I]``): the layout of pagedq's ``FusedMoE``. Experts of
that layout with SiLU gating run on the same kernels as the native block (C++ over weights
packed once on the CPU, Triton on CUDA); any other experts module (biases, another gate, a
transposed layout) runs transformers' own loop. On the CPU transformers' default
(``grouped_mm``) measured 0.04x the native block's tokens/s (``bench/model_impl.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import select_backend

EXPERTS_IMPLEMENTATION = "pagedq"


def fused_layout(module: nn.Module) -> bool:
    """True for experts pagedq's kernels run as they are: gated, concatenated, not transposed,
    no biases or post-norm, SiLU, the default gate."""
    from transformers.activations import SiLUActivation
    from transformers.integrations.moe import _default_apply_gate

    w13, w2 = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)):
        return False
    if w13.dim() != 3 or w2.dim() != 3:
        return False
    experts, two_i, hidden = w13.shape
    return (
        getattr(module, "has_gate", False)
        and getattr(module, "is_concatenated", False)
        and not getattr(module, "is_transposed", True)
        and not getattr(module, "has_bias", True)
        and not getattr(module, "has_post_expert_norm", True)
        and getattr(type(module), "_apply_gate", None) is _default_apply_gate
        and isinstance(getattr(module, "act_fn", None), (SiLUActivation, nn.SiLU))
        and tuple(w2.shape) == (experts, hidden, two_i // 2)
    )


def paged_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The ``ExpertsInterface`` function: ``sum_j weight_j * expert_j(x)`` of ``[tokens,
    hidden]``, in fp32 summed and rounded once to x's dtype."""
    packed = getattr(self, "packed", None)
    if packed is not None:
        from kernels.cpu_moe import fused_moe_cpu

        return fused_moe_cpu(hidden_states, packed, top_k_weights, top_k_index)
    backend = getattr(self, "pagedq_backend", None)
    if backend is not None and select_backend(hidden_states.device, backend) == "triton":
        from kernels.triton_moe import fused_experts_triton

        return fused_experts_triton(
            hidden_states, self.gate_up_proj, self.down_proj, top_k_weights, top_k_index
        )
    # transformers' own loop over the experts (the undecorated forward).
    return type(self).forward.__wrapped__(self, hidden_states, top_k_index, top_k_weights)


def prepare(hf_model: nn.Module, backend: str) -> int:
    """Mark the experts modules of the fused layout for pagedq's kernels (``backend``: the
    attention backend setting, which picks Triton as the attention does); the number marked."""
    count = 0
    for module in hf_model.modules():
        if fused_layout(module):
            module.pagedq_backend = backend
            count += 1
    return count


def prepack(hf_model: nn.Module) -> None:
    """Pack the marked experts once for the C++ kernel where it runs their dtype, releasing
    the plain 3-D weights (as ``FusedMoE.prepack``)."""
    from kernels.cpu_moe import fused_moe_available, pack_moe_weights

    for module in hf_model.modules():
        backend = getattr(module, "pagedq_backend", None)
        if backend is None or getattr(module, "packed", None) is not None:
            continue
        weight = module.gate_up_proj
        if select_backend(weight.device, backend) != "cpu" or not fused_moe_available(weight.dtype):
            continue
        module.packed = pack_moe_weights(weight.detach(), module.down_proj.detach())
        module.gate_up_proj = module.down_proj = None


def register() -> None:
    """Register ``paged_experts_forward`` as ``experts_implementation="pagedq"``."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, paged_experts_forward)
