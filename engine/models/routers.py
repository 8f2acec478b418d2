"""Routers of mixture-of-experts layers: which ``top_k`` experts each token goes to, and with
what weights, computed exactly as Hugging Face's families do.

- ``softmax_topk``: softmax over all experts, the top k, renormalised or not (Qwen2/3-MoE with
  ``norm_topk_prob``; Mixtral always renormalises).
- ``topk_softmax``: the top k logits, then a softmax over them (gpt-oss, whose router has a bias).
- ``topk_sigmoid``: the top k logits, each through a sigmoid (Llama 4, whose experts take the
  weight on their input: ``FusedMoE(router_weight_on_input=True)``).
- ``grouped_topk_sigmoid``: sigmoid scores; experts chosen by the scores plus
  ``e_score_correction_bias``, within the ``topk_group`` best of ``n_group`` groups (a group's
  score is the sum of its two best); weights from the uncorrected scores, renormalised, times
  ``routed_scaling_factor`` (GLM-4.5, DeepSeek-V3).
- ``grouped_topk_softmax``: softmax scores; experts chosen within the ``topk_group`` best of
  ``n_group`` groups, a group scored by its best expert (``group_score="max"``, DeepSeek-V2's
  ``group_limited_greedy``; one group is its ``greedy``) or by its two best (``"top2"``,
  Mistral 4); renormalised or not, times ``routed_scaling_factor``.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.linear import KeepsPackedDtypes, linear_fp32_out

SCORING = (
    "softmax_topk", "topk_softmax", "topk_sigmoid", "grouped_topk_sigmoid", "grouped_topk_softmax"
)  # fmt: skip
GROUP_SCORES = ("top2", "max")


def softmax_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights fp32, ids)`` of the ``top_k`` largest softmax probabilities."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, ids)``: the ``top_k`` largest logits and a softmax over them alone."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=values.dtype), ids


def group_mask(
    choice: torch.Tensor, n_group: int, topk_group: int, group_score: str = "top2"
) -> torch.Tensor:
    """``[tokens, experts]`` bool: the experts of each token's ``topk_group`` best groups, a
    group scored by the sum of its two best ``choice`` values or by its best one."""
    num_tokens, num_experts = choice.shape
    grouped = choice.view(num_tokens, n_group, -1)
    if group_score == "max":
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    return mask.unsqueeze(-1).expand(-1, -1, num_experts // n_group).reshape(num_tokens, -1).bool()


def grouped_topk_sigmoid(
    logits: torch.Tensor,
    top_k: int,
    correction_bias: torch.Tensor,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
    renormalize_eps: float = 1e-20,
    group_fill: float = float("-inf"),
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights fp32, ids)`` of DeepSeek-V3's grouped sigmoid routing (fp32 ``logits``); the
    experts outside the chosen groups score ``group_fill`` (A.X-K2: 0)."""
    scores = logits.sigmoid()
    choice = scores + correction_bias
    if n_group > 1:
        choice = choice.masked_fill(~group_mask(choice, n_group, topk_group), group_fill)
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True) + renormalize_eps
    return weights * routed_scaling_factor, ids


def grouped_topk_softmax(
    logits: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
    group_score: str = "top2",
    renormalize_eps: float = 1e-20,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights fp32, ids)`` of DeepSeek-V2's and Mistral 4's grouped softmax routing: the
    experts outside the chosen groups score 0, as transformers masks them."""
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    choice = scores
    if n_group > 1:
        choice = scores.masked_fill(~group_mask(scores, n_group, topk_group, group_score), 0.0)
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True) + renormalize_eps
    return weights * routed_scaling_factor, ids


class Router(KeepsPackedDtypes):
    """The gate of a mixture-of-experts layer: ``weight`` ``[E, hidden]`` (and ``bias`` ``[E]``
    with ``bias=True``; ``e_score_correction_bias`` ``[E]`` for grouped sigmoid routing).

    ``forward(x)`` gives ``(topk_weights fp32, topk_ids int64)``, both ``[tokens, top_k]``.
    ``round_weights`` rounds the weights to the model's dtype first, as Qwen3-MoE and gpt-oss
    do (Mixtral keeps them fp32). The logits are fp32 sums in every dtype (GLM-4.5 and
    DeepSeek-V3 compute them so; in bf16 others round them, and experts whose logits then tie
    are chosen by index, not by the model: measured 5x HF bf16's KL from fp32 on a Qwen3-MoE).
    ``fp32_weights`` keeps the weight and the correction bias fp32 in a bf16 model, as
    transformers keeps them for DeepSeek-V3, GLM-4.5, Nemotron-H and Kimi Linear
    (``_keep_in_fp32_modules_strict``): rounded, near-tied experts flip (3.1x HF bf16's KL from
    fp32 on a tiny Nemotron-H, bench/fidelity.py's measure).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        scoring: str = "softmax_topk",
        renormalize: bool = True,
        bias: bool = False,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        round_weights: bool = False,
        renormalize_eps: float = 1e-20,  # LFM2-MoE adds 1e-6 to the sum it divides by
        fp32_weights: bool = False,
        group_score: str = "top2",
        group_fill: float = float("-inf"),
    ) -> None:
        super().__init__()
        if scoring not in SCORING:
            raise ValueError(f"scoring={scoring!r} is not supported: must be one of {SCORING}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        if group_score not in GROUP_SCORES:
            raise ValueError(
                f"group_score={group_score!r} is not supported: must be one of {GROUP_SCORES}"
            )
        if scoring.startswith("grouped") and (
            num_experts % n_group or not 0 < topk_group <= n_group
        ):
            raise ValueError(
                f"n_group={n_group} must divide num_experts={num_experts} and "
                f"topk_group={topk_group} must be in [1, n_group]"
            )
        self.top_k, self.scoring, self.renormalize = top_k, scoring, renormalize
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.round_weights = round_weights
        self.renormalize_eps = renormalize_eps
        self.group_score, self.group_fill = group_score, group_fill
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_experts)) if bias else None
        if scoring == "grouped_topk_sigmoid":  # a parameter, so that checkpoints load it
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts), requires_grad=False
            )
        if fp32_weights:
            for param in self.parameters():
                param.keep_dtype = True

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear_fp32_out(x, self.weight, self.bias)
        if self.scoring == "softmax_topk":
            weights, ids = softmax_topk(logits, self.top_k, self.renormalize)
        elif self.scoring == "topk_softmax":
            weights, ids = topk_softmax(logits, self.top_k)
        elif self.scoring == "topk_sigmoid":
            values, ids = torch.topk(logits, self.top_k, dim=-1)
            weights = values.sigmoid()
        elif self.scoring == "grouped_topk_softmax":
            weights, ids = grouped_topk_softmax(
                logits, self.top_k, self.n_group, self.topk_group, self.renormalize,
                self.routed_scaling_factor, self.group_score, self.renormalize_eps,
            )  # fmt: skip
        else:
            weights, ids = grouped_topk_sigmoid(
                logits,
                self.top_k,
                self.e_score_correction_bias.float(),
                self.n_group,
                self.topk_group,
                self.renormalize,
                self.routed_scaling_factor,
                self.renormalize_eps,
                self.group_fill,
            )
        if self.round_weights:
            weights = weights.to(x.dtype)
        return weights.float(), ids
