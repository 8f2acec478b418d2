"""pagedq's weight-only quantized linear (kernels/csrc/quant_linear_cpu.cpp) against its bf16 GEMM
and fp32 ``F.linear``, one projection of a ~0.5B model per shape, weights from DRAM.

    python bench/quant_gemm.py                          # 3 shapes, 1 4 16 64 256 tokens
    python bench/quant_gemm.py --tokens 1 16 --shapes 1024x4096 --threads 1

Per shape, each kernel runs over copies of its layer that together outrun the caches
(``--cache-mb``), the kernels taking turns in one process so that a change in the machine's load
weighs on all. uint4 is group 128 with zero points, uint8 channel-wise symmetric, both on bf16 x
(bf16 out) as the bf16 GEMM (``packed_linear``); fp32 is ``F.linear`` on fp32 x. Prints each one's
milliseconds per call and the bf16 GEMM's time over the quantized kernels' (above 1: faster).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = ("1024x4096", "4096x1024", "1024x1536")  # in x out: gate/up, down, qkv
KERNELS = ("fp32", "bf16", "uint8", "uint4")


def layer(kernel: str, weight: torch.Tensor):
    """(x -> y, bytes read per call) of one copy of the layer."""
    from kernels.cpu_linear import pack_linear_weight, packed_linear
    from kernels.quant_linear import pack_uint4, quant_linear

    n, k = weight.shape
    if kernel == "fp32":
        w = weight.clone()
        return (lambda x: F.linear(x, w)), w.numel() * 4
    if kernel == "bf16":
        packed = pack_linear_weight(weight.bfloat16())
        return (lambda x: packed_linear(x, packed, n)), packed.numel() * 2
    if kernel == "uint4":
        groups = weight.unflatten(1, (k // 128, 128))
        lo, hi = groups.amin(-1), groups.amax(-1)
        scales = ((hi - lo) / 15).clamp_min(1e-8)
        zeros = (-lo / scales).round().clamp(0, 15)
        q = ((groups / scales[..., None]).round() + zeros[..., None]).clamp(0, 15).flatten(1)
        packed = pack_uint4(q)
        return (
            lambda x: quant_linear(x, packed, scales, zeros, "uint4", 128),
            packed.numel() + scales.numel() * 8,
        )
    scales = (weight.abs().amax(1, keepdim=True) / 127).clamp_min(1e-8)
    q = ((weight / scales).round() + 128).clamp(0, 255).to(torch.uint8)
    return (lambda x: quant_linear(x, q, scales, None, "uint8", k)), q.numel() + scales.numel() * 4


def shape_ms(k: int, n: int, tokens: list[int], cache_mb: int, repeats: int) -> dict:
    """Median milliseconds per call, {(kernel, tokens): ms}, over copies of each layer."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=gen) * 0.02
    copies = {}
    for kernel in KERNELS:
        fn, size = layer(kernel, weight)
        count = max(1, math.ceil(cache_mb * 2**20 / size))
        copies[kernel] = [fn] + [layer(kernel, weight)[0] for _ in range(count - 1)]
    ms = {}
    with torch.inference_mode():
        for m in tokens:
            x = torch.randn(m, k, generator=gen)
            inputs = {kr: x if kr == "fp32" else x.bfloat16() for kr in KERNELS}
            times = {kr: [] for kr in KERNELS}
            for round_ in range(repeats + 1):
                for kernel in KERNELS:
                    start = time.perf_counter()
                    for fn in copies[kernel]:
                        fn(inputs[kernel])
                    if round_:  # the first round warms up
                        times[kernel].append((time.perf_counter() - start) / len(copies[kernel]))
            for kernel in KERNELS:
                ms[kernel, m] = statistics.median(times[kernel]) * 1e3
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="in x out")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--cache-mb", type=int, default=64, help="bytes of layer copies per kernel")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from kernels.cpu_linear import packed_linear_available
    from kernels.quant_linear import quant_linear_cpu_available

    if not (quant_linear_cpu_available() and packed_linear_available(torch.bfloat16)):
        sys.exit("the C++ kernels (quant_linear, bf16 packed_linear) are not available here")
    print(f"{torch.get_num_threads()} threads; uint4: group 128 with zeros; uint8: channel-wise")
    print(
        "| in x out | tokens | fp32 ms | bf16 ms | uint8 ms | uint4 ms "
        "| bf16 / uint4 | bf16 / uint8 | fp32 / uint4 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        ms = shape_ms(k, n, args.tokens, args.cache_mb, args.repeats)
        for m in args.tokens:
            t = {kernel: ms[kernel, m] for kernel in KERNELS}
            print(
                f"| {shape} | {m} | {t['fp32']:.3f} | {t['bf16']:.3f} | {t['uint8']:.3f} | "
                f"{t['uint4']:.3f} | {t['bf16'] / t['uint4']:.2f} | "
                f"{t['bf16'] / t['uint8']:.2f} | {t['fp32'] / t['uint4']:.2f} |"
            )


if __name__ == "__main__":
    main()
