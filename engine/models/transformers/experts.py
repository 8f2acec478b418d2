"""pagedq's fused MoE kernels as a transformers experts implementation (``ExpertsInterface``).

transformers 5 keeps a family's experts as 3-D tensors (``gate_up_proj`` ``[E, 2I, H]``, gate
rows then up rows; ``down_proj`` ``[E, H, I]``): the layout of pagedq's ``FusedMoE``. Experts of
that layout with SiLU gating run on the same kernels as the native block (C++ over weights
packed once on the CPU, Triton on CUDA); any other experts module (biases, another gate, a
transposed layout) runs transformers' own loop. On the CPU transformers' default
(``grouped_mm``) measured 0.04x the native block's tokens/s (``bench/model_impl.py``).

Past one rank (``split``) experts of the fused layout split as ``FusedMoE`` splits them
(``moe_parallel``: whole experts, "ep", or every expert's intermediate features, "tp"); each
rank computes its share of the routed sum in fp32, one all-reduce adds the shares up.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from engine.parallel.state import all_reduce, divide, tp_rank, tp_size
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
    if getattr(self, "pagedq_share", None) is not None:  # split over the ranks
        return all_reduce(_rank_share(self, hidden_states, top_k_index, top_k_weights)).to(
            hidden_states.dtype
        )
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


def split(module: nn.Module, mode: str) -> None:
    """Make a fused-layout experts module (built, not loaded) this rank's share: experts
    ``[r E/N, (r+1) E/N)`` whole ("ep") or every expert's ``I/N`` features ("tp"), each loaded
    from the whole fused checkpoint tensor."""
    n, rank = tp_size(), tp_rank()
    num_experts, two_i, hidden = module.gate_up_proj.shape
    experts, inter = num_experts, two_i // 2
    if mode == "ep":
        experts = divide(num_experts, n, "num_experts")
    else:
        inter = divide(inter, n, "expert intermediate_size")
    expert0, inter0 = rank * experts if mode == "ep" else 0, rank * inter if mode == "tp" else 0
    module.pagedq_share = (mode, expert0, experts, inter0, inter)
    full13, full2 = (num_experts, two_i, hidden), (num_experts, hidden, two_i // 2)
    dtype = module.gate_up_proj.dtype
    module.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden, dtype=dtype))
    module.down_proj = nn.Parameter(torch.empty(experts, hidden, inter, dtype=dtype))
    for param, full in ((module.gate_up_proj, full13), (module.down_proj, full2)):
        param.checkpoint_shape = lambda shard, full=full: full
        param.weight_loader = partial(_load_share, module)


def _load_share(module: nn.Module, param: nn.Parameter, tensor: torch.Tensor, shard) -> None:
    """This rank's experts and features of a whole fused tensor (``gate_up_proj``: each
    expert's gate rows, then its up rows; ``down_proj``: features in the last dim)."""
    _, expert0, experts, inter0, inter = module.pagedq_share
    tensor = tensor.narrow(0, expert0, experts)
    if param is module.gate_up_proj:
        tensor = torch.cat([t.narrow(1, inter0, inter) for t in tensor.chunk(2, dim=1)], dim=1)
    else:
        tensor = tensor.narrow(2, inter0, inter)
    param.data.copy_(tensor)


def _rank_share(
    module: nn.Module, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """This rank's part of the routed experts' weighted sum, fp32 ``[tokens, hidden]`` (as
    ``FusedMoE._rank_share``)."""
    mode, expert0, experts, _, _ = module.pagedq_share
    if mode == "tp":
        return _fused(module, x, topk_weights, topk_ids)
    ids = topk_ids - expert0
    token, slot = ((ids >= 0) & (ids < experts)).nonzero(as_tuple=True)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if token.numel():
        pairs = (topk_weights[token, slot, None], ids[token, slot, None])
        out.index_add_(0, token, _fused(module, x[token], *pairs))
    return out


def _fused(module: nn.Module, x, topk_weights, topk_ids) -> torch.Tensor:
    args = (x, module.gate_up_proj, module.down_proj, topk_weights, topk_ids)
    if select_backend(x.device, getattr(module, "pagedq_backend", "auto")) == "triton":
        from kernels.triton_moe import fused_experts_triton

        return fused_experts_triton(*args, out_dtype=torch.float32)
    from kernels.reference import fused_experts_torch

    return fused_experts_torch(*args, out_dtype=torch.float32)


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
