"""Compile every kernel for NVIDIA targets and print one JSON line of results per case.

Run as a script without TRITON_INTERPRET (the interpreter replaces kernels by Python functions
that cannot be compiled): ``python tests/kernels/compile_cuda.py``.
"""

import json
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import kernels.triton_attention as attention  # noqa: E402
import kernels.triton_kv_write as kv_write  # noqa: E402
import kernels.triton_rmsnorm as rmsnorm  # noqa: E402
import kernels.triton_rotary as rotary  # noqa: E402
import kernels.triton_split_decode as split_decode  # noqa: E402

METADATA = ("block_table_ptr", "seq_lens_ptr", "query_start_loc_ptr", "slot_mapping_ptr",
            "positions_ptr")  # fmt: skip
FP32_BUFFERS = ("partial_out_ptr", "partial_m_ptr", "partial_l_ptr", "cos_ptr", "sin_ptr",
                "alibi_ptr")  # fmt: skip
ATTENTION = dict(NUM_QUERIES_PER_KV=4, BLOCK_SIZE=16, TILE_N=32, HEAD_PAD=128, INTERPRET=False)
PLAIN = dict(USE_WINDOW=False, USE_SOFT_CAP=False, HAS_ALIBI=False)
# A sliding window, a soft cap and ALiBi.
OPTIONS = dict(USE_WINDOW=True, USE_SOFT_CAP=True, HAS_ALIBI=True)
KERNELS = {
    "unified_attention": (
        attention._unified_attention_kernel,
        dict(ATTENTION, **PLAIN, HAS_SINKS=False, BLOCK_Q=16, BLOCK_M=64, DOT_PRECISION="tf32"),
    ),
    "unified_attention_options": (
        attention._unified_attention_kernel,
        dict(ATTENTION, **OPTIONS, HAS_SINKS=True, BLOCK_Q=16, BLOCK_M=64, DOT_PRECISION="tf32"),
    ),
    "split_decode": (
        split_decode._split_decode_kernel,
        dict(ATTENTION, **PLAIN, BLOCK_M=16, NUM_SPLITS=8, DOT_PRECISION="tf32"),
    ),
    "split_decode_options": (
        split_decode._split_decode_kernel,
        dict(ATTENTION, **OPTIONS, BLOCK_M=16, NUM_SPLITS=8, DOT_PRECISION="tf32"),
    ),
    "split_reduce": (
        split_decode._split_reduce_kernel,
        dict(HEAD_PAD=128, NUM_SPLITS=8, INTERPRET=False, HAS_SINKS=False),
    ),
    "split_reduce_sinks": (
        split_decode._split_reduce_kernel,
        dict(HEAD_PAD=128, NUM_SPLITS=8, INTERPRET=False, HAS_SINKS=True),
    ),
    "write_kv": (
        kv_write._write_kv_kernel,
        dict(BLOCK_SIZE=16, HEADS_PAD=8, HEAD_DIM_PAD=128, INTERPRET=False),
    ),
    "rms_norm": (rmsnorm._rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK=1024, INTERPRET=False)),
    "rotary": (
        rotary._rotary_kernel,
        dict(HALF=64, HALF_PAD=64, Q_HEADS_PAD=32, K_HEADS_PAD=8, INTERPRET=False),
    ),
}
# (compute capability, activation dtype, dtype of the index tensors)
TARGETS = [(80, "bf16", "i64"), (90, "fp16", "i32"), (80, "fp32", "i32")]


def compile_for(kernel, arch: int, dtype: str, index_dtype: str, constexprs: dict) -> None:
    """Compile ``kernel`` to a cubin, typing each ``*_ptr`` from its name, scalars as i32/fp32."""
    if dtype == "fp32" and "DOT_PRECISION" in constexprs:
        constexprs = dict(constexprs, DOT_PRECISION="ieee")
    signature, values = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            values[(i,)] = constexprs[name]
        elif name in METADATA:
            signature[name] = f"*{index_dtype}"
        elif name in FP32_BUFFERS:
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = f"*{dtype}"
        else:
            signature[name] = "fp32" if name in ("qk_scale", "eps", "soft_cap") else "i32"
    source = ASTSource(fn=kernel, signature=signature, constexprs=values)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32))
    assert compiled.asm["cubin"], "no cubin"


def main() -> None:
    for name, (kernel, constexprs) in KERNELS.items():
        for arch, dtype, index_dtype in TARGETS:
            case = f"{name}-sm{arch}-{dtype}-{index_dtype}"
            try:
                compile_for(kernel, arch, dtype, index_dtype, constexprs)
                error = None
            except Exception as e:  # reported per case by the test
                error = f"{type(e).__name__}: {e}"[:2000]
            print(json.dumps({"case": case, "error": error}), flush=True)


if __name__ == "__main__":
    main()
