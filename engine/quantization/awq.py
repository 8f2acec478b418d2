"""AWQ checkpoints (AutoAWQ's GEMM version; ``quant_method: awq``).

Per linear: ``qweight`` int32 ``[K, N / 8]`` and ``qzeros`` int32 ``[G, N / 8]``, eight 4-bit
values a word packed along the output in AWQ's interleaved order (the word's ``i``-th nibble is
column ``[0, 2, 4, 6, 1, 3, 5, 7][i]`` of its eight), and ``scales`` fp16 ``[G, N]``; the weight
is ``(q - zero) * scale``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quantization.packing import PackedWeight, unpack_int32

# Column c of a word is its nibble REVERSE_ORDER[c] (the inverse of AutoAWQ's [0, 2, 4, 6, 1,
# 3, 5, 7]).
REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
VERSIONS = ("gemm",)


@dataclass(frozen=True, slots=True)
class AWQFormat:
    """The fields of an AWQ ``quantization_config`` that decide the layout."""

    group_size: int

    marker = "qweight"
    parts = ("qweight", "qzeros", "scales")
    required = parts

    @classmethod
    def parse(cls, qc: dict) -> AWQFormat:
        """From ``quantization_config``; refuses a field pagedq cannot run, naming it."""
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise ValueError(
                f"quantization_config.bits={bits!r} is not supported: must be one of (4,)"
            )
        version = str(qc.get("version", "gemm")).lower()
        if version not in VERSIONS:
            raise ValueError(
                f"quantization_config.version={qc.get('version')!r} is not supported: must be one "
                f"of {VERSIONS}"
            )
        if qc.get("zero_point", True) is not True:
            raise ValueError(
                f"quantization_config.zero_point={qc.get('zero_point')!r} is not supported: must "
                "be one of (True,)"
            )
        group_size = qc.get("group_size", qc.get("q_group_size", -1))
        if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
            raise ValueError(
                f"quantization_config.group_size={group_size!r} is not supported: must be a "
                "positive multiple of 32, or -1"
            )
        return cls(group_size)

    def convert(self, parts: dict[str, torch.Tensor], name: str) -> PackedWeight:
        """One linear's tensors in pagedq's layout."""
        q = _unpack_awq(parts["qweight"])  # [K, N]
        zeros = _unpack_awq(parts["qzeros"])  # [G, N]
        scales = parts["scales"]
        k, n = q.shape
        if tuple(scales.shape) != tuple(zeros.shape) or scales.shape[1] != n:
            raise ValueError(
                f"weight {name!r}: scales {tuple(scales.shape)} and qzeros {tuple(zeros.shape)} "
                f"do not match qweight {tuple(parts['qweight'].shape)} (K={k}, N={n})"
            )
        groups = scales.shape[0]
        group_size = k // groups if self.group_size == -1 else self.group_size
        if groups * group_size != k:
            raise ValueError(
                f"weight {name!r}: {groups} groups of group_size={group_size} do not cover the "
                f"{k} input features"
            )
        return PackedWeight.from_values(q.T, scales.T, zeros.T, 4)


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    values = unpack_int32(packed, 4, dim=1)  # nibbles in word order
    rows, cols = values.shape
    return values.view(rows, cols // 8, 8)[:, :, list(REVERSE_ORDER)].reshape(rows, cols)
