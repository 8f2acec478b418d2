"""One projection, prepacked for oneDNN: fp32, bf16, and bf16 widened to fp32, per batch.

    python bench/bf16_linear.py                  # the default model's shapes, batches 64 256

What the dtype probe (engine/dtype_probe.py) decides from, shown per projection: on a CPU where
oneDNN's bf16 products beat fp32 (AMX; a Zen 4 with AVX512-BF16) bf16 runs natively, elsewhere
widened to fp32. Calls of the three take turns per shape; prints microseconds per call and each
one's speed relative to fp32.
"""

from __future__ import annotations

import argparse
import time

import torch

# SmolLM2-135M, (out_features, in_features)
SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def per_call_us(fn, x, calls: int) -> float:
    """Microseconds per call of fn(x), after a warm-up."""
    for _ in range(3):
        fn(x)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    linear = torch.ops.mkldnn._linear_pointwise
    print("| projection | batch | fp32 us | bf16 us | bf16 speed | widened us | widened speed |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        for name, (out_f, in_f) in SHAPES.items():
            w = torch.randn(out_f, in_f) * 0.02
            x = torch.randn(batch, in_f)
            p32 = torch.ops.mkldnn._reorder_linear_weight(w)
            pbf = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16())
            xb = x.bfloat16()
            calls = max(3, args.calls // 5) if name == "lm_head" else args.calls
            with torch.inference_mode():
                fp32 = per_call_us(lambda t, w=p32: linear(t, w, None, "none", [], ""), x, calls)
                bf16 = per_call_us(lambda t, w=pbf: linear(t, w, None, "none", [], ""), xb, calls)
                widened = per_call_us(
                    lambda t, w=p32: linear(t.float(), w, None, "none", [], "").bfloat16(),
                    xb,
                    calls,
                )
            print(
                f"| {name} | {batch} | {fp32:.1f} | {bf16:.1f} | {fp32 / bf16:.2f}x | "
                f"{widened:.1f} | {fp32 / widened:.2f}x |"
            )


if __name__ == "__main__":
    main()
