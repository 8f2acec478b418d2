"""GPTQ checkpoints (AutoGPTQ, GPTQModel; ``quant_method: gptq``).

Per linear: ``qweight`` int32 ``[K * bits / 32, N]`` (packed along the input, lowest bits first),
``qzeros`` int32 ``[G, N * bits / 32]`` (packed along the output), ``scales`` fp16 ``[G, N]``
and ``g_idx`` int32 ``[K]``, the group of each input column. ``checkpoint_format: gptq`` (v1)
stores each zero point minus one, ``gptq_v2`` the zero point itself. With ``desc_act`` (act
order) the columns were quantized in another order and ``g_idx`` is not ``k // group_size``:
pagedq sorts the columns by group and the layer permutes its input the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quantization.packing import PackedWeight, sort_by_group, unpack_int32

BITS = (4, 8)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True, slots=True)
class GPTQFormat:
    """The fields of a GPTQ ``quantization_config`` that decide the layout."""

    bits: int
    group_size: int  # -1: one group per row
    checkpoint_format: str
    desc_act: bool = False

    marker = "qweight"
    parts = ("qweight", "qzeros", "scales", "g_idx")
    required = ("qweight", "qzeros", "scales")

    @classmethod
    def parse(cls, qc: dict) -> GPTQFormat:
        """From ``quantization_config``; refuses a field pagedq cannot run, naming it."""
        bits = qc.get("bits")
        if bits not in BITS:
            raise ValueError(
                f"quantization_config.bits={bits!r} is not supported: must be one of {BITS}"
            )
        fmt = (
            qc.get("checkpoint_format") or (qc.get("meta") or {}).get("checkpoint_format") or "gptq"
        )
        if fmt not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"quantization_config.checkpoint_format={fmt!r} is not supported: must be one of "
                f"{CHECKPOINT_FORMATS}"
            )
        group_size = qc.get("group_size", -1)
        if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
            raise ValueError(
                f"quantization_config.group_size={group_size!r} is not supported: must be a "
                "positive multiple of 32, or -1 (one group per output row)"
            )
        return cls(bits, group_size, fmt, bool(qc.get("desc_act", False)))

    def convert(self, parts: dict[str, torch.Tensor], name: str) -> PackedWeight:
        """One linear's tensors in pagedq's layout."""
        q = unpack_int32(parts["qweight"], self.bits, dim=0)  # [K, N]
        k, n = q.shape
        zeros = unpack_int32(parts["qzeros"], self.bits, dim=1)[:, :n]  # [G, N]
        if self.checkpoint_format == "gptq":
            zeros = zeros + 1  # v1 stores zero - 1 (unmasked: a stored 2**bits - 1 means 2**bits)
        scales = parts["scales"]
        groups = scales.shape[0]
        if zeros.shape[0] != groups or scales.shape[1] != n:
            raise ValueError(
                f"weight {name!r}: scales {tuple(scales.shape)} and qzeros do not match qweight "
                f"{tuple(parts['qweight'].shape)} ({self.bits} bits: K={k}, N={n})"
            )
        group_size = k // groups if self.group_size == -1 else self.group_size
        if groups * group_size != k:
            raise ValueError(
                f"weight {name!r}: {groups} groups of group_size={group_size} do not cover the "
                f"{k} input features"
            )
        values, perm = sort_by_group(q.T, parts.get("g_idx"), group_size, name)
        return PackedWeight.from_values(values, scales.T, zeros.T, self.bits, perm)
