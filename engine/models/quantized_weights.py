"""Quantized checkpoints, dequantized as they load: MXFP4 experts (gpt-oss) and block-wise FP8
(DeepSeek-V3, Qwen3 FP8), to fp32, which the model then casts to its dtype.

- MXFP4 (OCP microscaling): ``<name>_blocks`` ``[..., rows, G, 16]`` uint8 holds two E2M1
  values a byte (low nibble first) for each block of 32 along the input; ``<name>_scales``
  ``[..., rows, G]`` uint8 is each block's E8M0 exponent, ``2 ** (byte - 127)``. The result is
  transposed to ``[..., G * 32, rows]``, the layout transformers' gpt-oss holds
  (``transformers/integrations/mxfp4.py``).
- FP8: ``<name>.weight`` (``float8_e4m3fn``) times ``<name>.weight_scale_inv`` (fp32, one per
  ``weight_block_size`` block of rows x columns; edge blocks are partial)
  (``transformers/integrations/finegrained_fp8.py``).

Every value and exponent is exact in fp32 and bf16, so the weights equal Hugging Face's
dequantized ones bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

DEQUANTIZED_METHODS = ("mxfp4", "fp8")
# Kept packed (engine/quantization): the loader takes them past ``dequantized``.
QUANT_METHODS = (*DEQUANTIZED_METHODS, "gptq", "awq", "compressed-tensors")
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., G * 32, rows]`` of MXFP4 ``blocks`` ``[..., rows, G, 16]`` and E8M0
    ``scales`` ``[..., rows, G]``."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match: "
            "blocks must be [..., G, 16] over scales [..., G]"
        )
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    packed = blocks.to(torch.uint8)
    values = torch.stack((lut[(packed & 0x0F).long()], lut[(packed >> 4).long()]), dim=-1)
    exponents = scales.to(torch.int32) - 127
    out = torch.ldexp(values.flatten(-2), exponents[..., None])  # [..., rows, G, 32]
    return out.flatten(-2).transpose(-1, -2).contiguous()


def dequantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block_size: list[int] | None
) -> torch.Tensor:
    """fp32 ``weight * scale_inv``, one scale per ``block_size`` block (per tensor if None)."""
    w = weight.to(torch.float32)
    scale = scale_inv.to(torch.float32)
    if block_size is None or scale.numel() == 1:
        return w * scale
    rows, cols = w.shape[-2:]
    block_rows, block_cols = block_size
    expected = (-(-rows // block_rows), -(-cols // block_cols))
    if tuple(scale.shape[-2:]) != expected:
        raise ValueError(
            f"FP8 scales {tuple(scale.shape)} do not match weight {tuple(w.shape)} in blocks of "
            f"{block_size}: expected {expected}"
        )
    scale = scale.repeat_interleave(block_rows, -2)[..., :rows, :]
    scale = scale.repeat_interleave(block_cols, -1)[..., :cols]
    return w * scale


def quantization_method(config) -> str | None:
    """The checkpoint's ``quantization_config.quant_method``, checked; None when unquantized."""
    qc = getattr(config, "quantization_config", None)
    if not qc:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method not in QUANT_METHODS:
        raise ValueError(
            f"quantization_config.quant_method={method!r} is not supported: must be one of "
            f"{QUANT_METHODS} (or an unquantized checkpoint)"
        )
    if method == "fp8" and qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"quantization_config.activation_scheme={qc.get('activation_scheme')!r} is not "
            "supported: must be 'dynamic' (the weights are dequantized; activations stay "
            "unquantized)"
        )
    return method


def dequantized(
    weights: Iterable[tuple[str, torch.Tensor]], config
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's named tensors with quantized pairs joined and dequantized; the others
    unchanged. A quantized tensor without its partner is refused, naming it."""
    method = quantization_method(config)
    if method not in DEQUANTIZED_METHODS:
        yield from weights
        return
    qc = config.quantization_config
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    block_size = qc.get("weight_block_size")
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        key, part = _pair_part(name, tensor, method)
        if key is None:
            yield name, tensor
            continue
        parts = pending.setdefault(key, {})
        parts[part] = tensor
        if len(parts) == 2:
            del pending[key]
            if method == "mxfp4":
                yield key, dequantize_mxfp4(parts["blocks"], parts["scales"])
            else:
                yield key, dequantize_fp8(parts["weight"], parts["scale"], block_size)
    if pending:
        key, parts = next(iter(pending.items()))
        raise ValueError(
            f"quantized weight {key!r} has its {sorted(parts)} but not its partner "
            f"({method} checkpoints store each weight as a pair)"
        )


def _pair_part(name: str, tensor: torch.Tensor, method: str) -> tuple[str | None, str]:
    """``(the dequantized tensor's name, which half this is)``, or ``(None, "")``."""
    if method == "mxfp4":
        for part in ("blocks", "scales"):
            if name.endswith(f"_{part}"):
                return name.removesuffix(f"_{part}"), part
        return None, ""
    if name.endswith(".weight_scale_inv"):
        return name.removesuffix("_scale_inv"), "scale"
    if tensor.dtype in _FP8_DTYPES:
        return name, "weight"
    return None, ""
