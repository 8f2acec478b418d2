"""Engine configuration and the resolution of its "auto" values."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
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
    admission_reserve_blocks: int = 4
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU; None = physical cores

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
        if self.num_threads is not None and (
            isinstance(self.num_threads, bool)
            or not isinstance(self.num_threads, int)
            or self.num_threads < 1
        ):
            raise ValueError(
                f"num_threads={self.num_threads!r} is invalid: must be None (auto) or an int >= 1"
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


def physical_cores() -> int:
    """Physical cores this process may run on: its CPU affinity, one thread per core.

    SMT siblings share a core's FPUs, so a GEMM-bound step gains nothing from them and loses
    to the synchronisation; ``/proc/cpuinfo``'s (physical id, core id) pairs tell them apart.
    """
    allowed = os.sched_getaffinity(0)
    cores: set[tuple[str, str]] = set()
    try:
        with open("/proc/cpuinfo") as f:
            blocks = f.read().split("\n\n")
    except OSError:
        return len(allowed)
    for block in blocks:
        fields = dict(
            (k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in block.splitlines())
        )
        if fields.get("processor", "").isdigit() and int(fields["processor"]) in allowed:
            cores.add((fields.get("physical id", "0"), fields.get("core id", fields["processor"])))
    return max(1, min(len(cores) or len(allowed), len(allowed)))


def apply_num_threads(num_threads: int | None, device: torch.device) -> int:
    """Set torch's intra-op threads for a CPU engine (``None`` = physical cores); returns it."""
    if device.type != "cpu":
        return torch.get_num_threads()
    wanted = num_threads or physical_cores()
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)
    return wanted
