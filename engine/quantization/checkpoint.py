"""A quantized checkpoint as it loads: which layers it quantizes (read from its tensor names and
shapes before any data), the layers swapped for ``QuantizedLinear``, and the stream of
checkpoint tensors turned into pagedq's packed ones.

A layer the checkpoint quantizes but pagedq keeps unquantized (an LM head, fused MoE experts,
MLA's ``kv_b_proj``) gets its weight dequantized once as it loads.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.quantization.awq import AWQFormat
from engine.quantization.compressed_tensors import SKIPPED_PARTS, CompressedTensorsFormat
from engine.quantization.gptq import GPTQFormat
from engine.quantization.linear import QuantizedLinear, swappable
from engine.quantization.moe import quantize_experts

log = logging.getLogger(__name__)

FORMATS = {"gptq": GPTQFormat, "awq": AWQFormat, "compressed-tensors": CompressedTensorsFormat}


class QuantizedCheckpoint:
    """The quantized layers of one checkpoint (``tensors``: every tensor's name -> (shape,
    dtype), read from the safetensors headers)."""

    def __init__(self, method: str, qc: dict, tensors: dict[str, tuple[tuple, str]]) -> None:
        self.method = method
        self.format = FORMATS[method].parse(qc)
        marker = self.format.marker
        self.parts: dict[str, set[str]] = {}
        for name in tensors:
            prefix, _, part = name.rpartition(".")
            if part == marker:
                self.parts[prefix] = set()
        for name in tensors:
            prefix, _, part = name.rpartition(".")
            if prefix in self.parts and part in self.format.parts:
                self.parts[prefix].add(part)
        for prefix, parts in self.parts.items():
            missing = [p for p in self.format.required if p not in parts]
            if missing:
                raise ValueError(
                    f"quantized weight {prefix!r} has no {missing} ({method} checkpoint)"
                )
        self.tensors = tensors
        self.swapped: set[str] = set()  # checkpoint prefixes that load packed

    def quantize_layers(self, net: nn.Module) -> None:
        """Swap every layer the checkpoint quantizes, and pagedq can run packed, for a
        ``QuantizedLinear`` (MoE experts: packed stacks in their ``FusedMoE``); the others load
        dequantized."""
        from engine.models.moe import FusedMoE

        by_target: dict[str, list[str]] = {}
        for prefix in self.parts:
            name = net.checkpoint_name(prefix.removeprefix("model.") + ".weight")
            if name is not None:
                by_target.setdefault(net.split_target(name)[0], []).append(prefix)
        experts: dict[str, dict[str, list[str]]] = {}
        for target, prefixes in by_target.items():
            path, _, attr = target.rpartition(".")
            owner = _submodule(net, path)
            if isinstance(owner, FusedMoE) and attr in ("w13_weight", "w2_weight"):
                experts.setdefault(path, {})[attr] = prefixes
                continue
            module = _submodule(net, target.removesuffix(".weight"))
            if module is None or not swappable(module):
                continue
            spec = self._same_spec(target, prefixes, module.in_features * tp_size_of(module))
            parent, _, name = target.removesuffix(".weight").rpartition(".")
            setattr(_submodule(net, parent), name, QuantizedLinear(module, *spec))
            self.swapped.update(prefixes)
        for path, stems in experts.items():
            moe = _submodule(net, path)
            if set(stems) != {"w13_weight", "w2_weight"}:
                continue
            spec13 = self._same_spec(path, stems["w13_weight"], moe.hidden_size)
            spec2 = self._same_spec(path, stems["w2_weight"], moe.intermediate_size)
            if spec13[0] != spec2[0] or spec13[2] != spec2[2] or spec13[3] or spec2[3]:
                continue  # mixed schemes or act order: dequantized
            quantize_experts(moe, spec13[0], spec13[1], spec2[1], spec13[2])
            self.swapped.update(stems["w13_weight"] + stems["w2_weight"])
        log.info(
            "%s checkpoint: %d projections stay packed, %d load dequantized",
            self.method, len(self.swapped), len(self.parts) - len(self.swapped),
        )  # fmt: skip

    def _same_spec(self, where: str, prefixes: list[str], full_in: int) -> tuple:
        """The one spec of the checkpoint layers that load into ``where``."""
        specs = {prefix: self._spec(prefix, full_in) for prefix in prefixes}
        if len(set(specs.values())) > 1:
            raise ValueError(
                f"the projections loaded into {where!r} are quantized differently: {specs}"
            )
        return next(iter(specs.values()))

    def _spec(self, prefix: str, full_in: int) -> tuple[str, int, bool, bool]:
        """(weight type, groups over the whole input, zero points?, act order?) of a layer
        of ``full_in`` input features."""
        parts, shape = self.parts[prefix], self.tensors
        if self.method in ("gptq", "awq"):
            groups = shape[f"{prefix}.scales"][0][0]
            bits = self.format.bits if self.method == "gptq" else 4
            return ("uint4" if bits == 4 else "uint8"), groups, True, self._has_perm(prefix)
        scale_shape = shape[f"{prefix}.weight_scale"][0]
        groups = 1 if len(scale_shape) < 2 else scale_shape[1]
        act_order = self._has_perm(prefix)
        if "weight_packed" in parts:
            bits = 32 * shape[f"{prefix}.weight_packed"][0][1] // full_in
            return ("uint4" if bits == 4 else "uint8"), groups, True, act_order
        if shape[f"{prefix}.weight"][1] in ("F8_E4M3", "float8_e4m3fn"):
            return "float8_e4m3fn", groups, False, False
        return "uint8", groups, True, act_order

    def convert(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's named tensors with each quantized layer's parts joined: packed
        under pagedq's names for a swapped layer, dequantized as ``<prefix>.weight`` for
        another; input and KV cache scales left out; everything else unchanged."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            prefix, _, part = name.rpartition(".")
            if part in SKIPPED_PARTS:
                continue
            if prefix not in self.parts or part not in self.parts[prefix]:
                yield name, tensor
                continue
            got = pending.setdefault(prefix, {})
            got[part] = tensor
            if len(got) < len(self.parts[prefix]):
                continue
            del pending[prefix]
            packed = self.format.convert(got, prefix)
            if prefix not in self.swapped:
                yield f"{prefix}.weight", packed.dequantize()
                continue
            if packed.perm is None and self._has_perm(prefix):
                packed.perm = torch.arange(_in_features(packed))
            yield from packed.named(prefix)
        if pending:
            prefix, got = next(iter(pending.items()))
            raise ValueError(
                f"quantized weight {prefix!r} has {sorted(got)} but not all of "
                f"{sorted(self.parts[prefix])}"
            )

    def _has_perm(self, prefix: str) -> bool:
        parts = self.parts[prefix]
        return (
            "g_idx" in parts and getattr(self.format, "desc_act", False)
        ) or "weight_g_idx" in parts


def _submodule(net: nn.Module, path: str) -> nn.Module | None:
    try:
        return net.get_submodule(path) if path else net
    except AttributeError:
        return None


def _in_features(packed) -> int:
    return packed.qweight.shape[1] * (2 if packed.weight_type == "uint4" else 1)


def tp_size_of(module: nn.Module) -> int:
    """How many ranks split ``module``'s input features (a row-parallel layer's), else 1."""
    from engine.parallel.layers import RowParallelLinear
    from engine.parallel.state import tp_size

    return tp_size() if isinstance(module, RowParallelLinear) else 1
