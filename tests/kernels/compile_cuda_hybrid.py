"""Compile the linear-attention and latent-attention Triton kernels for NVIDIA targets and print
one JSON line of results per case (as ``compile_cuda.py`` does for the attention kernels).

Run as a script without TRITON_INTERPRET: ``python tests/kernels/compile_cuda_hybrid.py``.
"""

import json
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import kernels.triton_causal_conv1d as conv  # noqa: E402
import kernels.triton_gated_delta as gated_delta  # noqa: E402
import kernels.triton_mla as mla  # noqa: E402
import kernels.triton_recurrent as recurrent  # noqa: E402

INDEX = ("query_start_loc_ptr", "state_indices_ptr", "seq_lens_ptr", "block_table_ptr",
         "slot_mapping_ptr")  # fmt: skip
FP32 = ("g_ptr", "beta_ptr", "state_ptr")  # the recurrent state is fp32 whatever the model's
FLOATS = ("scale", "qk_scale")
KERNELS = {
    "gated_delta": (
        recurrent.delta_rule_recurrent_kernel,
        dict(
            HAS_INITIAL_MASK=True,
            USE_QK_L2NORM=True,
            PER_CHANNEL_DECAY=False,
            BLOCK_K=128,
            BLOCK_V=64,
            INTERPRET=False,
        ),
    ),  # fmt: skip
    "gated_delta_chunked": (
        gated_delta._chunked_kernel,
        # small tiles: the front end is what this checks; full tiles take ptxas ~40 s here
        dict(
            HAS_INITIAL_MASK=True,
            USE_QK_L2NORM=True,
            BLOCK_K=32,
            BLOCK_V=16,
            BLOCK_T=16,
            INTERPRET=False,
        ),
    ),
    "causal_conv1d": (
        conv._causal_conv1d_kernel,
        dict(
            KERNEL=4,
            WIDTH_PAD=4,
            HAS_BIAS=True,
            HAS_INITIAL_MASK=True,
            SILU=True,
            BLOCK_T=16,
            BLOCK_C=64,
            INTERPRET=False,
        ),
    ),  # fmt: skip
    "mla_attention": (
        mla._mla_attention_kernel,
        dict(
            BLOCK_H=16,
            RANK_PAD=512,
            ROPE_PAD=64,
            BLOCK_SIZE=16,
            TILE_N=16,
            DOT_PRECISION="tf32",
            INTERPRET=False,
        ),
    ),  # fmt: skip
    "write_latent": (
        mla._write_latent_kernel,
        dict(BLOCK_SIZE=16, RANK_PAD=512, ROPE_PAD=64, INTERPRET=False),
    ),
}
TARGETS = [(80, "bf16", "i64"), (90, "fp16", "i32"), (80, "fp32", "i32")]


def compile_for(kernel, arch: int, dtype: str, index_dtype: str, constexprs: dict) -> None:
    """Compile ``kernel`` to a cubin, typing each pointer from its name."""
    if dtype == "fp32" and "DOT_PRECISION" in constexprs:
        constexprs = dict(constexprs, DOT_PRECISION="ieee")
    signature, values = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            values[(i,)] = constexprs[name]
        elif name in INDEX:
            signature[name] = f"*{index_dtype}"
        elif name == "has_initial_ptr":
            signature[name] = "*i1"
        elif name in FP32:
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = f"*{dtype}"
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
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
