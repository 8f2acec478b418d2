"""Tensor parallel for the Transformers backend, as vLLM's backend does it: the config's own
plan (``config.base_model_tp_plan``, e.g. ``"layers.*.self_attn.q_proj": "colwise"``) names the
linears split by output features ("colwise") or by input features ("rowwise"); each becomes
pagedq's ``ColumnParallelLinear`` or ``RowParallelLinear`` before the weights load, so each rank
narrows its rows or columns from the whole checkpoint tensor. The embedding becomes a
``VocabParallelEmbedding``, the LM head a ``ParallelLMHead`` (logits gathered), fused experts
split as ``engine/models/moe.py`` splits them (``experts.split``).

transformers' attention reshapes with ``-1`` heads, so a module whose q/k/v projections are
split sees this rank's heads (the probe checks it); the head counts the module holds are set to
this rank's too. A module the plan leaves whole (or gathers whole: "colwise_gather_output")
runs whole on every rank, which computes the same.

What cannot split is refused naming ``tensor_parallel_size`` and why: no plan, heads that do
not divide, a per-head weight the plan leaves whole (sinks, a q/k norm over the whole
projection), experts of a layout pagedq's kernels do not run.
"""

from __future__ import annotations

import re

from torch import nn

from engine.models.transformers import experts
from engine.parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from engine.parallel.state import moe_parallel, tp_size

SPLIT = {"colwise": ColumnParallelLinear, "rowwise": RowParallelLinear}
# The head counts attention modules hold (for their reshapes or repeats): this rank's, once
# their projections split. ``num_key_value_groups`` (their ratio) stays.
HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")


def refusal(config, n: int) -> str | None:
    """Why ``config``'s model cannot split over ``n`` ranks, or None: checked before any rank
    starts (``engine.models.check_parallel``) and again as each rank builds."""
    if not getattr(config, "base_model_tp_plan", None):
        return (
            f"config.base_model_tp_plan is empty: transformers has no tensor-parallel plan for "
            f"model_type={config.model_type!r}"
        )
    heads, kv_heads = head_counts(config)
    if not isinstance(heads, int):
        return f"config.num_attention_heads is {heads!r}: no head count to split"
    if heads % n:
        return f"config.num_attention_heads={heads} is not divisible by tensor_parallel_size={n}"
    if kv_heads % n:
        return (
            f"config.num_key_value_heads={kv_heads} is not divisible by "
            f"tensor_parallel_size={n} (the Transformers backend splits KV heads, it does not "
            "replicate them)"
        )
    return None


def head_counts(config) -> tuple[int | None, int | None]:
    """``(q heads, KV heads)`` of the config: KV heads only where its class declares them (a
    stray ``num_key_value_heads`` on GPT-NeoX's config is not its count), else the q heads."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    declared = hasattr(type(config), "num_key_value_heads")
    return heads, kv_heads if declared and kv_heads else heads


def plan_regex(plan: dict[str, str], style: str) -> re.Pattern | None:
    """The module names (relative to the base model) the plan gives ``style``: ``*`` is a layer
    index."""
    names = [re.escape(k).replace(r"\*", r"\d+") for k, v in plan.items() if v == style]
    return re.compile("|".join(f"(?:{n})" for n in names)) if names else None


def split(hf_model: nn.Module) -> None:
    """Make ``hf_model`` (built, not loaded) this rank's shard of the whole model."""
    n, config = tp_size(), hf_model.config
    reason = refusal(config, n)
    if reason is not None:
        raise ValueError(f"tensor_parallel_size={n}: {reason}")
    base = getattr(hf_model, hf_model.base_model_prefix)
    split_linears(base, config.base_model_tp_plan, n)
    for name, module in base.named_modules():
        if experts.fused_layout(module):
            experts.split(module, moe_parallel())
        elif _holds_experts(module):
            raise ValueError(
                f"tensor_parallel_size={n}: {type(module).__name__} ({name}) holds experts of a "
                "layout pagedq's MoE kernels do not run (biases, another gate or layout); the "
                "Transformers backend splits fused SiLU experts only"
            )
    split_embeddings(hf_model)


def split_linears(base: nn.Module, plan: dict[str, str], n: int) -> None:
    """Replace each ``nn.Linear`` the plan splits; refuse a per-head weight left whole beside
    the split ones, naming it."""
    regexes = {style: plan_regex(plan, style) for style in SPLIT}
    parents: dict[str, set[int]] = {}
    for name, module in list(base.named_modules()):
        style = next((s for s, r in regexes.items() if r and r.fullmatch(name)), None)
        if style is None:
            continue
        if type(module) is not nn.Linear:
            raise ValueError(
                f"tensor_parallel_size={n}: the plan splits {name} ({style}), a "
                f"{type(module).__name__}; the Transformers backend splits nn.Linear only"
            )
        parent_name, _, child = name.rpartition(".")
        parent = base.get_submodule(parent_name)
        layer = SPLIT[style](module.in_features, module.out_features, module.bias is not None)
        setattr(parent, child, layer.to(module.weight.dtype))
        # The whole width this rank holds a slice of: output features, or input features.
        width = module.out_features if style == "colwise" else module.in_features
        parents.setdefault(parent_name, set()).add(width)
    heads = set(head_counts(base.config))
    for parent_name, widths in parents.items():
        parent = base.get_submodule(parent_name)
        _refuse_whole_per_head(parent_name, parent, widths | heads, n)
        for attr in HEAD_COUNTS:
            value = getattr(parent, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(parent, attr, value // n)


def _refuse_whole_per_head(name: str, parent: nn.Module, widths: set[int], n: int) -> None:
    """Refuse a weight beside split linears that is per head or per split feature (its size is
    a head count or a split linear's whole width): the plan leaves it whole, this rank's
    activations are a slice."""
    for param_name, param in parent.named_parameters():
        owner = param_name.rpartition(".")[0]
        if isinstance(parent.get_submodule(owner) if owner else parent, tuple(SPLIT.values())):
            continue
        if widths.intersection(param.shape):
            raise ValueError(
                f"tensor_parallel_size={n}: {name}.{param_name} {tuple(param.shape)} holds "
                "per-head weights that config.base_model_tp_plan does not split (sinks, a q/k "
                "norm over the whole projection): the Transformers backend cannot split it"
            )


def _holds_experts(module: nn.Module) -> bool:
    """Experts kept as 3-D tensors (``gate_up_proj``, ``down_proj``...)."""
    return any(p.dim() == 3 for p in module.parameters(recurse=False))


def split_embeddings(hf_model: nn.Module) -> None:
    """A plain embedding table becomes vocabulary-parallel, and a plain bias-free LM head (or
    the tied one) the parallel head; any other (scaled, biased) stays whole on every rank."""
    embed, head = hf_model.get_input_embeddings(), hf_model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    if type(embed) is nn.Embedding:
        table = VocabParallelEmbedding(embed.num_embeddings, embed.embedding_dim)
        hf_model.set_input_embeddings(table.to(embed.weight.dtype))
        if tied:
            parallel_head = ParallelLMHead(embed.num_embeddings, embed.embedding_dim)
            parallel_head.weight = table.weight  # its loader: the table's
            hf_model.set_output_embeddings(parallel_head)
            return
    if not tied and type(head) is nn.Linear and head.bias is None:
        parallel_head = ParallelLMHead(head.out_features, head.in_features)
        hf_model.set_output_embeddings(parallel_head.to(head.weight.dtype))


def check_heads(calls, config) -> None:
    """Each attention call sees this rank's heads (its projections split) or all of them (the
    plan keeps it whole), q and KV alike; refused naming the module otherwise."""
    n = tp_size()
    heads, kv_heads = head_counts(config)
    for i, call in enumerate(calls):
        seen = (call.num_heads, call.num_kv_heads)
        if seen not in ((heads // n, kv_heads // n), (heads, kv_heads)):
            raise ValueError(
                f"tensor_parallel_size={n}: {type(call.module).__name__} (layer {i}) attends "
                f"with {seen[0]} q and {seen[1]} KV heads, neither this rank's "
                f"({heads // n}, {kv_heads // n}) nor all ({heads}, {kv_heads}): the plan "
                "splits its projections in a way the Transformers backend does not know"
            )
