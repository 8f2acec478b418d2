"""Engine configuration and the resolution of its "auto" values."""

from __future__ import annotations

import re
from dataclasses import dataclass

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
    priority_aging_seconds: float | None = 60.0
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
