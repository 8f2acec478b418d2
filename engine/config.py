"""Engine configuration and the resolution of its "auto" values."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# "auto": Triton on CUDA, the C++ kernels on the CPU (torch reference without a compiler).
ATTENTION_BACKENDS = ("auto", "triton", "cpu", "torch")
_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


@dataclass(slots=True)
class EngineConfig:
    """Everything ``LLMEngine`` needs; "auto" values are resolved when the engine starts."""

    model: str = "smollm2"
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_cache_memory: int | float | str | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    # A waiting request's priority improves by 1 per this many seconds (None: no aging); it is
    # also the wait after which the fair policy's starvation boost is full. See SCHEDULING.md.
    priority_aging_seconds: float | None = 60.0
    # GiB of host memory for swap preemption (0: recompute only).
    swap_space: float = 4.0
    # Share weights of tenants under the "fair" policy; unnamed tenants weigh 1.
    tenant_weights: dict[str, float] = field(default_factory=dict)
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    admission_reserve_blocks: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64):
            raise ValueError(f"block_size={self.block_size} is invalid: must be 8, 16, 32 or 64")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 1")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(
                f"dtype={self.dtype!r} is invalid: must be 'auto' or one of {list(DTYPES)}"
            )
        if isinstance(self.swap_space, bool) or not (
            isinstance(self.swap_space, int | float) and self.swap_space >= 0
        ):
            raise ValueError(f"swap_space={self.swap_space!r} is invalid: must be GiB >= 0")
        for tenant, weight in self.tenant_weights.items():
            if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
                raise ValueError(
                    f"tenant_weights[{tenant!r}]={weight!r} is invalid: must be a number > 0"
                )
        if self.priority_aging_seconds is not None and self.priority_aging_seconds <= 0:
            raise ValueError(
                f"priority_aging_seconds={self.priority_aging_seconds!r} is invalid: "
                "must be > 0 or None"
            )
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in DTYPES:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is invalid: must be 'auto' (the model "
                f"dtype) or one of {list(DTYPES)}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend={self.attention_backend!r} is invalid: must be one of "
                f"{list(ATTENTION_BACKENDS)}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} is invalid: "
                "must be in (0, 1]"
            )


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda when present, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bf16 where the device computes it fast, else fp32."""
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and _cpu_has_fast_bf16():
        return torch.bfloat16
    return torch.float32


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """``auto`` -> the model's dtype; else the named one (attention upcasts K/V to fp32)."""
    return model_dtype if kv_cache_dtype == "auto" else DTYPES[kv_cache_dtype]


def _cpu_has_fast_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def parse_memory(value: int | float | str) -> int:
    """Bytes from an int (bytes), a float below 1024 (GiB) or a string like "2GiB", "512MB"."""
    if isinstance(value, bool):
        raise ValueError(f"kv_cache_memory={value!r} is invalid")
    if isinstance(value, int) and value >= 1024:
        return value
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"kv_cache_memory={value!r} is invalid: must be > 0")
        return int(value * 2**30)
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(
            f"kv_cache_memory={value!r} is invalid: give bytes, GiB as a number, or e.g. '2GiB'"
        )
    unit = (m.group(2) or "").lower()[:1]
    return int(float(m.group(1)) * _UNITS[unit])
