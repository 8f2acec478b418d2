"""The C++ paged attention for CPUs, built at first use and registered as ``torch.ops.pagedq``.

``kernels/csrc/*.cpp`` (the paged attention, RMSNorm, SiLU-and-mul and the packed projections)
are compiled with ``torch.utils.cpp_extension`` (g++ and ninja) into a cache directory the first
time a process needs it; later processes load the cached library directly, without a compiler.
Where no compiler or ninja is found, or the build fails, ``cpu_kernels_available()`` warns once
and returns False, and callers use the torch reference.

Environment:

- ``PAGEDQ_KERNEL_CACHE``: where builds go (else ``TORCH_EXTENSIONS_DIR``, else
  ``~/.cache/pagedq/kernels``).
- ``PAGEDQ_CPU_ARCH``: the ``-march`` of the build, ``native`` by default; an image built for other
  hosts sets a portable one (``x86-64-v3``); ``none`` leaves ``-march`` out.
- ``PAGEDQ_CPU_KERNELS=0``: never build or load; always the torch reference.
- ``PAGEDQ_CPU_AMX=0``: decodes over a bf16 cache take the AVX path even where the CPU has AMX
  (read at each call).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(
    CSRC / name
    for name in (
        "paged_attention_cpu.cpp",
        "layers_cpu.cpp",
        "linear_cpu.cpp",
        "moe_cpu.cpp",
        "gated_delta_cpu.cpp",
        "mamba_ssm_cpu.cpp",
        "kimi_delta_cpu.cpp",
        "causal_conv1d_cpu.cpp",
        "mla_cpu.cpp",
        "quant_linear_cpu.cpp",
    )
)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)

_lock = threading.Lock()
_status: dict[str, object] = {}  # "ok": bool, "reason": str once decided


def cache_dir() -> Path:
    """The directory that holds the compiled kernels."""
    root = os.environ.get("PAGEDQ_KERNEL_CACHE") or os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "pagedq" / "kernels"


def build_flags() -> list[str]:
    """Compiler flags: -O3, OpenMP (for ``at::parallel_for``) and ``-march`` from the env."""
    flags = ["-O3", "-fopenmp", "-fno-math-errno", "-DNDEBUG"]
    arch = os.environ.get("PAGEDQ_CPU_ARCH", "native").strip()
    if arch and arch != "none":
        flags.append(f"-march={arch}")
    return flags


def extension_name() -> str:
    """A name unique to the source, the flags and the torch version, so stale builds never load."""
    digest = hashlib.sha256()
    # The compiled sources and the headers they share: a .cpp not (yet) in SOURCES must not
    # name a build that lacks it.
    for path in sorted((*SOURCES, *CSRC.glob("*.h"))):
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join(build_flags()).encode())
    digest.update(torch.__version__.encode())
    return f"pagedq_cpu_{digest.hexdigest()[:12]}"


def _compiler() -> str | None:
    cxx = os.environ.get("CXX") or "c++"
    return shutil.which(cxx) or (None if os.environ.get("CXX") else shutil.which("g++"))


def _load() -> str | None:
    """Load (building if needed) the library; None on success, else why it is unavailable."""
    if os.environ.get("PAGEDQ_CPU_KERNELS", "1") == "0":
        return "PAGEDQ_CPU_KERNELS=0"
    name = extension_name()
    build_dir = cache_dir() / name
    library = build_dir / f"{name}.so"
    if library.exists():
        torch.ops.load_library(str(library))
        return None
    if _compiler() is None:
        return f"no C++ compiler found (CXX={os.environ.get('CXX', 'c++')!r})"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(
            name=name,
            sources=[str(path) for path in SOURCES],
            extra_cflags=build_flags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
        )
    except Exception as exc:  # a failed build must not stop the engine: it has a fallback
        return f"the build failed: {str(exc).strip().splitlines()[-1] if str(exc) else exc!r}"
    return None


def cpu_kernels_available() -> bool:
    """True once ``torch.ops.pagedq`` is loaded; builds it at the first call of the process."""
    if "ok" not in _status:
        with _lock:
            if "ok" not in _status:
                reason = _load()
                _status["reason"] = reason or ""
                _status["ok"] = reason is None
                if reason is not None:
                    warnings.warn(
                        f"pagedq: the C++ CPU attention is unavailable ({reason}); "
                        "using the torch reference, which is slower",
                        RuntimeWarning,
                        stacklevel=2,
                    )
    return bool(_status["ok"])


def unavailable_reason() -> str:
    """Why the C++ kernels are unavailable ("" when they are loaded)."""
    cpu_kernels_available()
    return str(_status["reason"])


def _require() -> None:
    if not _status.get("ok") and not cpu_kernels_available():
        raise RuntimeError(f"the C++ CPU attention is unavailable: {unavailable_reason()}")


def supports(query_dtype: torch.dtype, kv_cache_dtype: torch.dtype) -> bool:
    """True when the C++ kernels handle this query and KV-cache dtype pair."""
    return query_dtype in SUPPORTED_DTYPES and kv_cache_dtype in SUPPORTED_DTYPES


def amx_decode_available() -> bool:
    """True when the kernel runs bf16-cache decodes on AMX tiles here (built for a CPU with AMX,
    the OS granted the tile state, ``PAGEDQ_CPU_AMX`` is not ``0``)."""
    _require()
    return bool(torch.ops.pagedq.amx_decode_available())


def unified_attention_cpu(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    kv_split_size: int = 0,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """C++ twin of ``unified_attention_torch``, reading K/V blocks in place.

    ``kv_split_size`` cuts key ranges into chunks of that many tokens (merged exactly afterwards);
    0 lets the kernel decide from the batch and the thread count. The options are
    ``kernels.attention_options``'s (None: plain causal attention).
    """
    _require()
    if out is None:
        out = torch.empty_like(query)
    torch.ops.pagedq.unified_attention(
        query, kv_cache, query_start_loc, seq_lens, block_table, float(scale), out, kv_split_size,
        sliding_window or 0, float(logits_soft_cap or 0.0), sinks, alibi_slopes,
    )  # fmt: skip
    return out


def write_kv_cpu(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """C++ twin of ``write_kv_torch``: scatter by slot, converting to the cache dtype."""
    _require()
    torch.ops.pagedq.write_kv(key, value, kv_cache, slot_mapping)


def rms_norm_cpu(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """C++ twin of ``rms_norm_torch``; a ``residual`` is updated in place to ``x + residual``."""
    _require()
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        torch.ops.pagedq.rms_norm(x2, weight, float(eps), out)
        return out.view(x.shape), None
    torch.ops.pagedq.fused_add_rms_norm(x2, residual.view(x2.shape), weight, float(eps), out)
    return out.view(x.shape), residual


def apply_token_bitmask_cpu(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> None:
    """C++ twin of ``apply_token_bitmask_torch``: -inf, in place, where the bits are clear."""
    _require()
    torch.ops.pagedq.apply_token_bitmask(logits, rows, mask)


def argmax_cpu(x: torch.Tensor) -> torch.Tensor:
    """C++ twin of ``x.argmax(dim=-1)`` for fp32 ``[rows, n]`` (rows in parallel)."""
    _require()
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    torch.ops.pagedq.argmax_rows(out, x)
    return out


def rotary_cpu(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """C++ twin of ``rotary_apply_torch``, in place on ``x`` ``[T, heads, D]`` (returned)."""
    _require()
    torch.ops.pagedq.rotary(x, cos, signed_sin)
    return x


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """C++ twin of ``silu_and_mul_torch`` (one pass, no gate/up copies)."""
    _require()
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
    torch.ops.pagedq.silu_and_mul(out, x)
    return out
