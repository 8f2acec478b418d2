"""Engine configuration and the resolution of its "auto" values."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.dtype_probe import probe_cpu_dtype

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# "auto": Triton on CUDA, the C++ kernels on the CPU (torch reference without a compiler).
ATTENTION_BACKENDS = ("auto", "triton", "cpu", "torch")
# "auto": the native family where the registry has one, else the Transformers backend.
MODEL_IMPLS = ("auto", "native", "transformers")
_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def _doc(text: str, **extra: Any) -> dict[str, Any]:
    """Field metadata: the help text of the setting (its `pagedq worker` flag), and e.g. choices."""
    return {"help": text, **extra}


@dataclass(slots=True)
class EngineConfig:
    """Everything ``LLMEngine`` needs; "auto" values are resolved when the engine starts."""

    model: str = field(
        default="smollm2",
        metadata=_doc("alias, .gguf file, local HF folder (safetensors) or hub id"),
    )
    dtype: str = field(
        default="auto",
        metadata=_doc(
            "auto (bf16 on CUDA, or fp16 without bf16; on CPU whichever of fp32 and bf16 a "
            "short measurement at first start finds faster, cached per CPU and torch version; "
            "pagedq's bf16 is as close to fp32 as Hugging Face's bf16: bench/fidelity.py), "
            "float32, bfloat16, float16"
        ),
    )
    device: str = field(
        default="auto", metadata=_doc("auto (cuda when present, else cpu), cpu, cuda, cuda:1 ...")
    )
    block_size: int = field(default=16, metadata=_doc("tokens per KV block (8, 16, 32 or 64)"))
    max_num_seqs: int = field(default=256, metadata=_doc("requests in the running batch at most"))
    max_num_batched_tokens: int = field(
        default=2048, metadata=_doc("tokens per step at most (prefill chunks plus decodes)")
    )
    max_model_len: int | None = field(
        default=None,
        metadata=_doc("longest prompt + output in tokens (none: the model's and KV cache's limit)"),
    )
    kv_cache_memory: int | float | str | None = field(
        default=None,
        metadata=_doc(
            "KV pool size: 512MiB, 4GiB or bytes (none: 2 GiB on CPU; on CUDA "
            "gpu_memory_utilization of the device memory)"
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=_doc("fraction of CUDA memory the engine may use (weights plus KV cache)"),
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=_doc("automatic prefix caching of full KV blocks")
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata=_doc("split long prompts over steps within the token budget")
    )
    # "fair" shares the engine between tenants (weighted fair queueing), then orders by
    # `priority` like "priority"; with one tenant it is "priority". See docs/SCHEDULING.md.
    scheduling_policy: str = field(
        default="fair",
        metadata=_doc(
            "order of the requests the engine holds: fair (tenants share by --tenant-weight, "
            "then priority), priority (lower `priority` first, ties by arrival, waiting "
            "requests age) or fcfs",
            choices=("fair", "priority", "fcfs"),
        ),
    )
    priority_aging_seconds: float | None = field(
        default=60.0,
        metadata=_doc(
            "a waiting request gains one priority level per this many seconds (none: no aging)"
        ),
    )
    swap_space: float = field(
        default=4.0,
        metadata=_doc("GiB of host memory for swap preemption (0: recompute only)"),
    )
    tenant_weights: dict[str, float] = field(
        default_factory=dict,
        metadata=_doc(
            "share weight of a tenant, NAME=W, repeatable (unnamed tenants weigh 1); also the "
            "weights of the queue's fair dequeue"
        ),
    )
    attention_backend: str = field(
        default="auto",
        metadata=_doc(
            "auto (triton on CUDA, the C++ kernel on CPU, else torch), triton, cpu or torch",
            choices=("auto", "triton", "cpu", "torch"),
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_doc("dtype of the KV cache: auto (the model dtype), bfloat16, float32, float16"),
    )
    admission_reserve_blocks: int = field(
        default=4,
        metadata=_doc("free KV blocks kept back when admitting a new request (room to decode)"),
    )
    seed: int = field(
        default=0, metadata=_doc("seed of the engine's sampler for unseeded requests")
    )
    num_threads: int | None = field(
        default=None,
        metadata=_doc(
            "torch intra-op threads on CPU (none: OMP_NUM_THREADS if set, else the physical "
            "cores it may use)"
        ),
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=_doc(
            "ranks the model is split over (one per GPU; on a CPU host, processes sharing its "
            "cores): attention heads, MLPs and the vocabulary split, MoE experts spread; one "
            "worker to Redis"
        ),
    )
    moe_parallel: str = field(
        default="ep",
        metadata=_doc(
            "how MoE layers split past one rank: ep (whole experts spread over the ranks) or "
            "tp (every expert's intermediate features split)",
            choices=("ep", "tp"),
        ),
    )
    model_impl: str = field(
        default="auto",
        metadata=_doc(
            "which implementation runs the model: auto (pagedq's native family where it has "
            "one, else the Transformers modeling backend), native (refuse other model types) or "
            "transformers (the backend even for a native family)",
            choices=MODEL_IMPLS,
        ),
    )
    max_grammar_compile_s: float = field(
        default=10.0,
        metadata=_doc(
            "seconds a structured-output grammar may take to compile; past it that request "
            "fails alone"
        ),
    )

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
        if self.num_threads is not None and (
            isinstance(self.num_threads, bool)
            or not isinstance(self.num_threads, int)
            or self.num_threads < 1
        ):
            raise ValueError(
                f"num_threads={self.num_threads!r} is invalid: must be None (auto) or an int >= 1"
            )
        if (
            isinstance(self.max_grammar_compile_s, bool)
            or not isinstance(self.max_grammar_compile_s, int | float)
            or not self.max_grammar_compile_s > 0
        ):
            raise ValueError(
                f"max_grammar_compile_s={self.max_grammar_compile_s!r} is invalid: "
                "must be seconds > 0"
            )
        if (
            isinstance(self.tensor_parallel_size, bool)
            or not isinstance(self.tensor_parallel_size, int)
            or self.tensor_parallel_size < 1
        ):
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size!r} is invalid: must be an "
                "int >= 1"
            )
        if self.moe_parallel not in ("ep", "tp"):
            raise ValueError(
                f"moe_parallel={self.moe_parallel!r} is invalid: must be one of ['ep', 'tp']"
            )
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(
                f"model_impl={self.model_impl!r} is invalid: must be one of {list(MODEL_IMPLS)}"
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
    """``auto`` -> bf16 on CUDA (fp16 without bf16 support); on the CPU whichever of fp32 and
    bf16 the host measured faster (``engine/dtype_probe.py``); fp32 elsewhere. A named dtype is
    returned as it is."""
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu":
        return probe_cpu_dtype().dtype
    return torch.float32


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """``auto`` -> the model's dtype; else the named one (attention upcasts K/V to fp32)."""
    return model_dtype if kv_cache_dtype == "auto" else DTYPES[kv_cache_dtype]


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
