"""Integers packed into int32 words, as AWQ, GPTQ and compressed-tensors store them, and the
one layout pagedq keeps them in (``kernels/quant_linear.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.quant_linear import pack_uint4


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The unsigned ``bits``-bit fields of int32 words along ``dim`` (0 or 1 of a 2-D tensor),
    lowest bits first: ``[R, C]`` words give ``[R * 32 / bits, C]`` or ``[R, C * 32 / bits]``
    int32 values."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(
            f"packed weights must be 2-D int32, got {packed.dtype} {tuple(packed.shape)}"
        )
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    if dim == 0:
        values = (packed[:, None, :] >> shifts[None, :, None]) & mask
        return values.reshape(packed.shape[0] * per_word, packed.shape[1])
    values = (packed[:, :, None] >> shifts) & mask
    return values.reshape(packed.shape[0], packed.shape[1] * per_word)


def sort_by_group(
    values: torch.Tensor, g_idx: torch.Tensor | None, group_size: int, name: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(values [N, K] with columns sorted by group, perm)`` for a ``g_idx`` (each input
    column's group, GPTQ's act order) that is not ``k // group_size``; ``(values, None)``
    where it is, or where there is none."""
    k = values.shape[1]
    in_order = torch.arange(k) // group_size
    if g_idx is None or torch.equal(g_idx.long(), in_order):
        return values, None
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], in_order):
        raise ValueError(f"weight {name!r}: g_idx does not give every group {group_size} columns")
    return values[:, perm], perm


@dataclass(slots=True)
class PackedWeight:
    """One linear's weight in pagedq's layout: ``qweight`` ``[N, K / 2]`` (uint4) or ``[N, K]``
    (uint8, float8_e4m3fn), ``scales`` and ``zeros`` ``[N, G]`` fp32, and ``perm`` (int64
    ``[K]``) where the columns were reordered so that groups are contiguous (GPTQ's act
    order): the layer reads ``x[:, perm]``."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    weight_type: str
    perm: torch.Tensor | None = None

    @classmethod
    def from_values(
        cls,
        values: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        bits: int,
        perm: torch.Tensor | None = None,
    ) -> PackedWeight:
        """From unsigned integer ``values`` ``[N, K]`` (0 .. 2**bits - 1) and ``[N, G]``
        scales and zero points."""
        if bits == 4:
            qweight, weight_type = pack_uint4(values), "uint4"
        elif bits == 8:
            qweight, weight_type = values.to(torch.uint8), "uint8"
        else:
            raise ValueError(f"bits={bits}: must be one of (4, 8)")
        zeros = None if zeros is None else zeros.to(torch.float32).contiguous()
        return cls(
            qweight.contiguous(), scales.to(torch.float32).contiguous(), zeros, weight_type, perm
        )

    def named(self, prefix: str) -> list[tuple[str, torch.Tensor]]:
        """The tensors under pagedq's names (what ``QuantizedLinear`` loads)."""
        out = [(f"{prefix}.qweight", self.qweight), (f"{prefix}.scales", self.scales)]
        if self.zeros is not None:
            out.append((f"{prefix}.zeros", self.zeros))
        if self.perm is not None:
            out.append((f"{prefix}.perm", self.perm))
        return out

    def dequantize(self) -> torch.Tensor:
        """The fp32 ``[N, K]`` weight in the checkpoint's column order (for layers pagedq keeps
        unquantized: embeddings, LM heads, fused experts)."""
        from kernels.quant_linear import dequantize

        k = self.qweight.shape[1] * (2 if self.weight_type == "uint4" else 1)
        group = k // self.scales.shape[1]
        w = dequantize(self.qweight, self.scales, self.zeros, self.weight_type, group)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out
