"""pagedq's own GEMM against oneDNN's, as a decode step meets them: one layer's projections over
copies of the layer too many for the caches (weights from DRAM), per token count.

    python bench/gemm.py                          # bf16 and fp32, 1 16 64 512 2048 tokens
    python bench/gemm.py --dtype bfloat16 --tokens 64 --copies 8

Both run ``engine.models.packed_linear.PackedLinear`` (``gemm="onednn"`` and ``"pagedq"``), in
turns, so that a change in the machine's load weighs on both; prints each one's milliseconds
for the layer's four projections and pagedq's time as a ratio of oneDNN's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# SmolLM2-135M, (out_features, in_features): QKV, O, gate/up, down
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
GEMMS = ("onednn", "pagedq")


def layer_ms(dtype: torch.dtype, tokens: int, copies: int, repeats: int) -> dict[str, float]:
    """Median milliseconds of one layer's projections per GEMM, over `copies` layer copies."""
    from engine.models.packed_linear import PackedLinear

    gen = torch.Generator().manual_seed(0)
    linears = {g: [] for g in GEMMS}
    inputs = []
    for out_features, in_features in SHAPES:
        weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(dtype)
        for gemm in GEMMS:
            copies_of = [PackedLinear(weight, gemm=gemm, widen=False) for _ in range(copies)]
            linears[gemm].append(copies_of)
        inputs.append(torch.randn(tokens, in_features, generator=gen).to(dtype))
    times = {g: [] for g in GEMMS}
    with torch.inference_mode():
        for round_ in range(repeats + 1):
            for gemm in GEMMS:
                start = time.perf_counter()
                for copy in range(copies):
                    for shape, x in enumerate(inputs):
                        linears[gemm][shape][copy](x)
                if round_:  # the first round warms up
                    times[gemm].append((time.perf_counter() - start) / copies)
    return {g: statistics.median(t) * 1e3 for g, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16,float32", help="comma list")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 512, 2048])
    ap.add_argument("--copies", type=int, default=8, help="layer copies (8: 56 MB in bf16)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from engine.models.packed_linear import pagedq_gemm_available

    print(f"{torch.get_num_threads()} threads, {args.copies} layer copies")
    print("| dtype | tokens | oneDNN ms | pagedq ms | pagedq / oneDNN |")
    print("|---|---:|---:|---:|---:|")
    for name in args.dtype.split(","):
        dtype = getattr(torch, name.strip())
        if not pagedq_gemm_available(dtype):
            print(f"| {name} | - | - | - | pagedq's GEMM is not built for {name} here |")
            continue
        for tokens in args.tokens:
            ms = layer_ms(dtype, tokens, args.copies, args.repeats)
            ratio = ms["pagedq"] / ms["onednn"]
            print(f"| {name} | {tokens} | {ms['onednn']:.3f} | {ms['pagedq']:.3f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
