"""compressed-tensors checkpoints (llm-compressor; ``quant_method: compressed-tensors``).

Per linear, by ``format``:

- ``pack-quantized`` (W4A16, W8A16): ``weight_packed`` int32 ``[N, K * bits / 32]`` (values
  offset by ``2 ** (bits - 1)`` to unsigned, lowest bits first), ``weight_scale`` ``[N, G]``,
  ``weight_shape`` ``[2]``, and where the scheme is asymmetric ``weight_zero_point`` int32
  ``[N * bits / 32, G]`` packed along the output the same way;
- ``int-quantized`` (W8A8 INT8): ``weight`` int8 ``[N, K]``, ``weight_scale`` ``[N, 1]`` (or
  one per tensor, or ``[N, G]``), ``weight_zero_point`` where asymmetric;
- ``float-quantized`` (W8A8 FP8): ``weight`` float8_e4m3fn ``[N, K]``, ``weight_scale`` per
  tensor, per row ``[N, 1]``, per group ``[N, G]`` or per block ``[N / bn, K / bk]``.

``weight_g_idx`` (act order by group) sorts the columns as GPTQ's ``desc_act`` does. Input
activation scales (``input_scale``; W8A8 schemes) are read past: pagedq runs these weights
with activations in the model's dtype, so the tokens are those of the dequantized weights.
Layers named in ``ignore`` are stored unquantized and load as such.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quantization.packing import PackedWeight, sort_by_group, unpack_int32

FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
NUM_BITS = (4, 8)
TYPES = ("int", "float")
STRATEGIES = ("tensor", "channel", "group", "block")
ACTIVATION_STRATEGIES = ("tensor", "token", "channel")
# Read past: activations are not quantized (see above); KV cache scales are not used.
SKIPPED_PARTS = ("input_scale", "input_zero_point", "output_scale", "k_scale", "v_scale")


@dataclass(frozen=True, slots=True)
class CompressedTensorsFormat:
    """A compressed-tensors ``quantization_config``, checked."""

    block_rows: int | None = None  # block strategy: rows per scale

    marker = "weight_scale"
    parts = (
        "weight",
        "weight_packed",
        "weight_scale",
        "weight_zero_point",
        "weight_shape",
        "weight_g_idx",
    )
    required = ("weight_scale",)

    @classmethod
    def parse(cls, qc: dict) -> CompressedTensorsFormat:
        """From ``quantization_config``; refuses a field pagedq cannot run, naming it."""
        _allowed("quantization_config.format", qc.get("format", "pack-quantized"), FORMATS)
        groups = qc.get("config_groups") or {}
        if not groups:
            raise ValueError(
                "quantization_config.config_groups is empty: nothing says how weights are stored"
            )
        block_rows = None
        for key, group in groups.items():
            where = f"quantization_config.config_groups.{key}"
            if "format" in group and group["format"] is not None:
                _allowed(f"{where}.format", group["format"], FORMATS)
            weights = group.get("weights")
            if not weights:
                raise ValueError(f"{where}.weights is empty: pagedq runs weight-quantized schemes")
            _allowed(f"{where}.weights.num_bits", weights.get("num_bits"), NUM_BITS)
            _allowed(f"{where}.weights.type", weights.get("type", "int"), TYPES)
            if weights.get("type") == "float" and weights.get("num_bits") != 8:
                raise ValueError(
                    f"{where}.weights.num_bits={weights.get('num_bits')!r} is not supported: "
                    "float weights must be 8 bits (FP8)"
                )
            _allowed(f"{where}.weights.strategy", weights.get("strategy", "tensor"), STRATEGIES)
            if weights.get("dynamic"):
                raise ValueError(
                    f"{where}.weights.dynamic=True is not supported: must be False (stored scales)"
                )
            if weights.get("strategy") == "block":
                block = weights.get("block_structure") or [128, 128]
                block_rows = int(block[0])
            acts = group.get("input_activations")
            if acts:
                _allowed(f"{where}.input_activations.num_bits", acts.get("num_bits"), (8,))
                _allowed(
                    f"{where}.input_activations.strategy",
                    acts.get("strategy", "tensor"),
                    ACTIVATION_STRATEGIES,
                )
            if group.get("output_activations"):
                raise ValueError(f"{where}.output_activations is not supported: must be null")
        return cls(block_rows)

    def convert(self, parts: dict[str, torch.Tensor], name: str) -> PackedWeight:
        """One linear's tensors in pagedq's layout."""
        if "weight_packed" in parts:
            return _packed(parts, name)
        weight = parts.get("weight")
        if weight is None:
            raise ValueError(f"weight {name!r} has a weight_scale but no weight or weight_packed")
        n, k = weight.shape
        scales = _row_scales(parts["weight_scale"], n, k, self.block_rows, name)
        if weight.dtype == torch.float8_e4m3fn:
            return PackedWeight(weight.contiguous(), scales, None, "float8_e4m3fn")
        if weight.dtype != torch.int8:
            raise ValueError(
                f"weight {name!r}: dtype {weight.dtype} is not supported: must be one of "
                "(torch.int8, torch.float8_e4m3fn)"
            )
        zeros = _zeros(parts.get("weight_zero_point"), scales, 128, offset=128)
        values, perm = sort_by_group(
            weight.to(torch.int32) + 128, parts.get("weight_g_idx"), k // scales.shape[1], name
        )
        return PackedWeight.from_values(values, scales, zeros, 8, perm)


def _packed(parts: dict[str, torch.Tensor], name: str) -> PackedWeight:
    packed = parts["weight_packed"]
    shape = parts.get("weight_shape")
    n = packed.shape[0]
    k = int(shape[1]) if shape is not None else None
    bits = 32 * packed.shape[1] // k if k else 4
    _allowed(f"weight {name!r} bits", bits, NUM_BITS)
    values = unpack_int32(packed, bits, dim=1)[:, : k or None]
    k = values.shape[1]
    scales = _row_scales(parts["weight_scale"], n, k, None, name)
    zp = parts.get("weight_zero_point")
    if zp is not None and zp.dtype == torch.int32:
        zp = unpack_int32(zp, bits, dim=0)[:n]  # already offset to unsigned
        offset = 0
    else:
        offset = 1 << (bits - 1)
    zeros = _zeros(zp, scales, 1 << (bits - 1), offset)
    values, perm = sort_by_group(values, parts.get("weight_g_idx"), k // scales.shape[1], name)
    return PackedWeight.from_values(values, scales, zeros, bits, perm)


def _row_scales(
    scale: torch.Tensor, n: int, k: int, block_rows: int | None, name: str
) -> torch.Tensor:
    """``[N, G]`` fp32 scales of a per-tensor, per-row, per-group or per-block scale."""
    s = scale.to(torch.float32)
    if s.numel() == 1:
        return s.reshape(1, 1).expand(n, 1).contiguous()
    if s.dim() == 1:
        s = s[:, None]
    if block_rows is not None and s.shape[0] != n:
        s = s.repeat_interleave(block_rows, dim=0)[:n]
    if s.shape[0] != n or k % s.shape[1]:
        raise ValueError(
            f"weight {name!r}: weight_scale {tuple(scale.shape)} does not fit a [{n}, {k}] weight"
        )
    return s.contiguous()


def _zeros(
    zp: torch.Tensor | None, scales: torch.Tensor, symmetric: int, offset: int = 0
) -> torch.Tensor:
    """Unsigned zero points ``[N, G]``: the scheme's offset where it is symmetric."""
    if zp is None:
        return torch.full_like(scales, float(symmetric))
    z = zp.to(torch.float32) + offset
    return z.reshape(scales.shape[0], -1).expand_as(scales).contiguous()


def _allowed(field: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{field}={value!r} is not supported: must be one of {allowed}")
