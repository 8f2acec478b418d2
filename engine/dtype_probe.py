"""``dtype="auto"`` on the CPU: fp32 or bf16, whichever runs the engine's step faster here; and
how bf16 projections run: in oneDNN's bf16, or widened to fp32, whichever is faster here.

Whether bf16 pays on a CPU depends on more than its flags: with AMX, bf16 projections took
0.18x the time of fp32 ones; with AVX512-BF16 alone 1.3-1.6x on an Intel host but 0.51-0.54x
on a Zen 4 host; with AVX2 only, bf16 is emulated (docs/PERFORMANCE.md). So the first start
on a host times one decoder layer's projections (QKV, O, gate/up, down of the default model)
at a decode batch and a prefill chunk, over copies of the layer too many for the caches, packed
as the engine runs them: fp32 and bf16 on oneDNN, bf16 weights widened to fp32 (bf16's numbers
at fp32's speed), and fp32 and bf16 on pagedq's own GEMM where it is built. It keeps the result
in the cache directory per CPU and torch version; later starts read it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.cpu_features import cpu_flags, cpuinfo_field

log = logging.getLogger(__name__)

PROBE_VERSION = (
    5  # bump when the measurement or a dtype's path changes: older files are measured again
)
# One SmolLM2-135M decoder layer, (out_features, in_features): QKV, O, gate/up, down. The
# engine picks its dtype before it reads the model's config, so the probe uses the default
# model's shapes; what it measures is how this CPU computes each dtype.
PROJECTIONS = ((960, 576), (576, 576), (3072, 576), (576, 1536))
TOKEN_COUNTS = (32, 128)  # a decode batch and a prefill chunk
# A step reads each layer's weights from DRAM once: the probe walks distinct copies of its layer
# (42 MB in bf16, more than a 32 MB L3) so that a GEMM which waits on those reads is timed
# waiting (oneDNN's did, 1.2-1.7x its cache-hot time; docs/PERFORMANCE.md).
LAYER_COPIES = 6
MAX_ROUNDS = 3
ROUNDS_BUDGET_S = 0.3  # no round starts past this (the first always runs)

# () -> (fp32 seconds, bf16 seconds as the engine runs it[, whether it widens bf16 to fp32,
# the fp32 GEMM, the bf16 GEMM]); the GEMMs are "onednn" or "pagedq"
Measure = Callable[[], tuple]


@dataclass(slots=True, frozen=True)
class DtypeProbe:
    """One host's measurement: seconds for the probe's projections in fp32 and in bf16, each
    the fastest way: bf16 in oneDNN's bf16, widened to fp32 (`widen_bf16`), or in pagedq's GEMM;
    `gemm_fp32` and `gemm_bf16` say whose GEMM ("onednn" or "pagedq") won."""

    float32_s: float
    bfloat16_s: float
    host: str
    version: int = PROBE_VERSION
    widen_bf16: bool = False
    gemm_fp32: str = "onednn"
    gemm_bf16: str = "onednn"

    @property
    def dtype(self) -> torch.dtype:
        """The faster dtype; a tie keeps fp32, the one that is exact against Hugging Face."""
        return torch.bfloat16 if self.bfloat16_s < self.float32_s else torch.float32


def host_key() -> str:
    """What the measurement depends on: the CPU (name, family/model, flags) and torch."""
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    name, family, model = (cpuinfo_field(f) or "?" for f in ("model name", "cpu family", "model"))
    return f"{name} family {family} model {model} flags {flags} torch {torch.__version__}"


def probe_cache_path(cache_dir: Path | None = None) -> Path:
    """``<$PAGEDQ_CACHE_DIR or ~/.cache/pagedq>/probes/dtype-<host>.json``."""
    if cache_dir is None:
        env = os.environ.get("PAGEDQ_CACHE_DIR")
        cache_dir = Path(env).expanduser() if env else Path.home() / ".cache" / "pagedq"
    slug = re.sub(r"[^A-Za-z0-9.+-]+", "_", host_key()).strip("_")
    return cache_dir / "probes" / f"dtype-{slug}.json"


def probe_cpu_dtype(measure: Measure | None = None, cache_dir: Path | None = None) -> DtypeProbe:
    """The cached probe of this host, else a fresh measurement (``measure``: the default is
    ``measure_projections``), which is then cached. A cache file that cannot be read, or is
    of another host or probe version, is measured again."""
    path = probe_cache_path(cache_dir)
    cached = _read(path)
    if cached is not None:
        _log(cached, f"cached in {path}")
        return cached
    float32_s, bfloat16_s, *extra = (measure or measure_projections)()
    widen, gemm_fp32, gemm_bf16 = (list(extra) + [False, "onednn", "onednn"][len(extra) :])[:3]
    probe = DtypeProbe(
        float32_s,
        bfloat16_s,
        host_key(),
        widen_bf16=bool(widen),
        gemm_fp32=gemm_fp32,
        gemm_bf16=gemm_bf16,
    )
    _write(path, probe)
    _log(probe, f"measured, cached in {path}")
    return probe


def measure_projections() -> tuple[float, float, bool, str, str]:
    """Median seconds of the projections of ``LAYER_COPIES`` layers at each of ``TOKEN_COUNTS``:
    (fp32 the faster way, bf16 the fastest way, whether that way is widening to fp32, the fp32
    GEMM, the bf16 GEMM).

    Whose GEMM runs a dtype is decided at the decode batch alone (the first token count): that
    is where they differ (pagedq's 0.75-0.9x oneDNN's time on a Zen 4 host, against 0.98-1.07x
    at prefill sizes) and where a generation spends its steps; summed with the prefill chunk,
    the choice flipped with the host's noise from one start to the next. After a warm-up call
    of each (oneDNN builds its kernels then), the ways take turns, so a change in the host's
    load weighs on all alike.
    """
    from kernels.packed_linear import onednn_packs, pagedq_gemm_available

    runs = {"float32": _projections(torch.float32, gemm="onednn")}
    if onednn_packs(torch.bfloat16):
        runs["bfloat16"] = _projections(torch.bfloat16, widen=False, gemm="onednn")
    runs["widened"] = _projections(torch.bfloat16, widen=True, gemm="onednn")
    if pagedq_gemm_available(torch.float32):
        runs["float32 pagedq"] = _projections(torch.float32, gemm="pagedq")
    if pagedq_gemm_available(torch.bfloat16):
        runs["bfloat16 pagedq"] = _projections(torch.bfloat16, widen=False, gemm="pagedq")
    for run in runs.values():
        run()
    times: dict[str, list[list[float]]] = {way: [] for way in runs}
    start = time.perf_counter()
    for round_ in range(MAX_ROUNDS):
        for way in list(runs)[:: 1 if round_ % 2 else -1]:
            times[way].append(runs[way]())
        if time.perf_counter() - start > ROUNDS_BUDGET_S:
            break
    # Per way, the median seconds at each token count.
    median = {way: [statistics.median(c) for c in zip(*t)] for way, t in times.items()}

    def pick(onednn_ways: list[str], pagedq_way: str) -> tuple[str, str]:
        best = min((w for w in onednn_ways if w in median), key=lambda w: sum(median[w]))
        if pagedq_way in median and median[pagedq_way][0] < median[best][0]:
            return pagedq_way, "pagedq"
        return best, "onednn"

    fp32, gemm_fp32 = pick(["float32"], "float32 pagedq")
    bf16, gemm_bf16 = pick(["bfloat16", "widened"], "bfloat16 pagedq")
    return sum(median[fp32]), sum(median[bf16]), bf16 == "widened", gemm_fp32, gemm_bf16


def _projections(dtype: torch.dtype, widen: bool = False, gemm: str = "onednn") -> Callable:
    """A call that runs every probe projection at every token count, as the engine runs
    ``dtype`` (bf16: `widen` or not) on `gemm`'s kernels, and returns the seconds per count."""
    from kernels.packed_linear import PackedLinear, prepack_supported

    gen = torch.Generator().manual_seed(0)
    packed = prepack_supported(torch.device("cpu"), dtype)
    layers = [[] for _ in range(LAYER_COPIES)]
    for out_features, in_features in PROJECTIONS:
        weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(dtype)
        for layer in layers:
            if packed:
                layer.append(PackedLinear(weight, widen=widen, gemm=gemm))
            else:
                copy = weight.clone()
                layer.append(lambda x, w=copy: F.linear(x, w))
    counts = []
    for num_tokens in TOKEN_COUNTS:
        inputs = [torch.randn(num_tokens, k, generator=gen).to(dtype) for _, k in PROJECTIONS]
        counts.append([(linear, x) for layer in layers for linear, x in zip(layer, inputs)])

    def run() -> list[float]:
        seconds = []
        with torch.inference_mode():
            for calls in counts:
                t0 = time.perf_counter()
                for linear, x in calls:
                    linear(x)
                seconds.append(time.perf_counter() - t0)
        return seconds

    return run


def _read(path: Path) -> DtypeProbe | None:
    try:
        probe = DtypeProbe(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    valid = (
        probe.version == PROBE_VERSION
        and probe.host == host_key()
        and {probe.gemm_fp32, probe.gemm_bf16} <= {"onednn", "pagedq"}
        and all(isinstance(t, int | float) and t > 0 for t in (probe.float32_s, probe.bfloat16_s))
    )
    return probe if valid else None


def _write(path: Path, probe: DtypeProbe) -> None:
    # Written aside and renamed: a worker starting at the same moment reads a whole file or none.
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(asdict(probe), indent=1) + "\n")
        tmp.replace(path)
    except OSError as exc:
        log.warning("dtype auto: could not cache the probe in %s (%s)", path, exc)


def _log(probe: DtypeProbe, how: str) -> None:
    log.info(
        "dtype auto on this CPU: %s, the faster of the faithful dtypes (bf16 keeps fp32 "
        "logits and is as close to fp32 as Hugging Face's bf16: bench/fidelity.py; %d layers' "
        "projections at %s tokens: fp32 %.1f ms, bf16 %.1f ms%s; GEMM fp32 %s, bf16 %s; %s)",
        str(probe.dtype).removeprefix("torch."),
        LAYER_COPIES,
        " and ".join(map(str, TOKEN_COUNTS)),
        probe.float32_s * 1e3,
        probe.bfloat16_s * 1e3,
        " widened to fp32" if probe.widen_bf16 else "",
        probe.gemm_fp32,
        probe.gemm_bf16,
        how,
    )
