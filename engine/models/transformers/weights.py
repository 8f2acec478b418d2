"""Checkpoint tensors into a Hugging Face model built by the Transformers backend.

A tensor whose name is a parameter (or persistent buffer) loads as it is; any other name goes
through transformers' own conversion mapping for the family (``WeightRenaming`` and
``WeightConverter``: e.g. per-expert ``experts.{e}.gate_proj`` / ``up_proj`` tensors stacked into
the fused ``experts.gate_up_proj``), exactly as ``from_pretrained`` converts them. Unknown and
missing tensors are refused naming them.
"""

from __future__ import annotations

from collections.abc import Iterable
from copy import deepcopy

import torch
from torch import nn

from engine.models.linear import load_param


class _Pending:
    """The checkpoint tensors one converter target collects before it converts."""

    def __init__(self, pattern_to_converter: dict, first_pattern: str) -> None:
        self.converter = pattern_to_converter[first_pattern]
        self.tensors: dict[str, list[tuple[str, torch.Tensor]]] = {}

    def add(self, pattern: str, key: str, tensor: torch.Tensor) -> None:
        self.tensors.setdefault(pattern, []).append((key, tensor))

    def complete(self, target: torch.Tensor) -> bool:
        """True once every source holds all its tensors: one per expert where the converter
        stacks a module list, else one."""
        from transformers.core_model_loading import MergeModulelist

        stacks = any(isinstance(op, MergeModulelist) for op in self.converter.operations)
        # The whole tensor's experts (a rank's share may hold fewer: ``experts.split``).
        shape = getattr(target, "checkpoint_shape", None)
        want = (shape(None) if shape is not None else target.shape)[0] if stacks else 1
        sources = self.converter.source_patterns
        return all(len(self.tensors.get(p, ())) == want for p in sources)

    def convert(self, target_name: str, hf_model: nn.Module) -> dict[str, torch.Tensor]:
        from transformers.core_model_loading import dot_natural_key

        converter = deepcopy(self.converter)  # it collects into itself: one copy per target
        for pattern, items in self.tensors.items():
            # Experts in numeric order (the stream may give experts.10 before experts.2).
            for key, tensor in sorted(items, key=lambda kv: dot_natural_key(kv[0])):
                converter.add_tensor(target_name, key, pattern, tensor)
        realized = converter.convert(target_name, model=hf_model, config=hf_model.config)
        return {k: v[0] if isinstance(v, list) else v for k, v in realized.items()}


def load_checkpoint(
    net: nn.Module, hf_model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], rename
) -> None:
    """Load ``weights`` into ``net`` (whose names are ``hf_model``'s); ``rename`` maps a
    checkpoint name to the model's (or None to skip it)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    targets = net.state_dict(keep_vars=True)  # parameters and persistent buffers
    transforms = get_model_conversion_mapping(hf_model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    pattern_to_converter = {p: c for c in converters for p in c.source_patterns}
    prefix = hf_model.base_model_prefix
    loaded: set[int] = set()
    pending: dict[str, _Pending] = {}

    def put(name: str, tensor: torch.Tensor, source: str) -> None:
        if name not in targets:
            raise ValueError(f"unexpected weight {source!r} for {hf_model.config.model_type}")
        load_param(targets[name], tensor, None, source)
        loaded.add(id(targets[name]))

    for hf_name, tensor in weights:
        name = rename(hf_name)
        if name is None:
            continue
        if name in targets:
            put(name, tensor, hf_name)
            continue
        # transformers' renames apply to the checkpoint's own name (they add or drop the
        # base model's prefix themselves).
        renamed, pattern = rename_source_key(hf_name, renamings, converters, prefix, targets)
        if pattern is None:
            put(renamed, tensor, hf_name)
            continue
        if renamed not in targets:
            raise ValueError(f"unexpected weight {hf_name!r} for {hf_model.config.model_type}")
        group = pending.setdefault(renamed, _Pending(pattern_to_converter, pattern))
        group.add(pattern, hf_name, tensor)
        if group.complete(targets[renamed]):
            for target, value in pending.pop(renamed).convert(renamed, hf_model).items():
                put(target, value, hf_name)
    for renamed, group in pending.items():
        for target, value in group.convert(renamed, hf_model).items():
            put(target, value, renamed)
    missing = sorted(name for name, t in targets.items() if id(t) not in loaded)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:5]}")
