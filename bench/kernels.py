"""Time each Triton kernel against its torch reference on a CUDA device.

Run ``make bench-kernels`` (or ``python bench/kernels.py``). For every kernel and shape it prints
the time of both backends, the speedup, and the Triton kernel's achieved bandwidth (bytes it must
move / time) as a share of the device's measured copy bandwidth: memory-bound kernels such as
decode attention should reach a large share of it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def copy_bandwidth(do_bench) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write)."""
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def paged_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """Inputs of one unified-attention call with shuffled blocks."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    blocks = [-(-s // block_size) for s in seq_lens]
    physical = torch.randperm(sum(blocks), device="cuda")
    block_table = torch.full((len(seq_lens), max(blocks)), -1, dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(blocks):
        block_table[i, :n] = physical[used : used + n]
        used += n
    kv_cache = torch.randn(2, sum(blocks), block_size, num_kv_heads, head_dim, dtype=dtype,
                           device="cuda")  # fmt: skip
    query = torch.randn(sum(query_lens), num_heads, head_dim, dtype=dtype, device="cuda")
    query_start_loc = torch.tensor([0, *query_lens], device="cuda").cumsum(0).to(torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    bytes_moved = (
        2 * sum(seq_lens) * num_kv_heads * head_dim * kv_cache.element_size()  # K and V, once
        + 2 * query.numel() * query.element_size()  # query in, output out
    )
    args = (query, kv_cache, query_start_loc, seq_lens_t, block_table, head_dim**-0.5)
    return args, bytes_moved


def cases(dtype, head_dim=128, num_heads=32, num_kv_heads=8, block_size=16):
    """(kernel, shape, triton fn, torch fn, bytes the kernel must move)."""
    from kernels.reference import unified_attention_torch, write_kv_torch
    from kernels.triton_attention import unified_attention_triton
    from kernels.triton_kv_write import write_kv_triton
    from kernels.triton_rmsnorm import rms_norm_torch, rms_norm_triton
    from kernels.triton_rotary import rotary_torch, rotary_triton

    attention = {
        "decode 64 x 1k": ([1] * 64, [1024] * 64),
        "decode 4 x 8k (split-K)": ([1] * 4, [8192] * 4),
        "prefill 4 x 512": ([512] * 4, [0] * 4),
        "mixed 2 chunks + 62 decodes": ([256, 256] + [1] * 62, [512, 0] + [1024] * 62),
    }
    for name, (query_lens, context_lens) in attention.items():
        args, nbytes = paged_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim,
                                   block_size, dtype)  # fmt: skip
        yield ("unified_attention", name, lambda a=args: unified_attention_triton(*a),
               lambda a=args: unified_attention_torch(*a), nbytes)  # fmt: skip

    for num_tokens in (64, 4096):
        key = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device="cuda")
        value = torch.randn_like(key)
        cache = torch.empty(2, num_tokens // block_size + 1, block_size, num_kv_heads, head_dim,
                            dtype=dtype, device="cuda")  # fmt: skip
        slots = torch.randperm(num_tokens, device="cuda")
        yield ("write_kv", f"{num_tokens} tokens",
               lambda k=key, v=value, c=cache, s=slots: write_kv_triton(k, v, c, s),
               lambda k=key, v=value, c=cache, s=slots: write_kv_torch(k, v, c, s),
               4 * key.numel() * key.element_size())  # fmt: skip

    hidden = num_heads * head_dim
    for num_tokens in (64, 4096):
        x = torch.randn(num_tokens, hidden, dtype=dtype, device="cuda")
        residual = torch.randn_like(x)
        weight = torch.randn(hidden, dtype=dtype, device="cuda")
        yield ("rms_norm + residual", f"{num_tokens} x {hidden}",
               lambda x=x, w=weight, r=residual: rms_norm_triton(x, w, 1e-6, r),
               lambda x=x, w=weight, r=residual: rms_norm_torch(x, w, 1e-6, r),
               4 * x.numel() * x.element_size())  # fmt: skip

        q = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device="cuda")
        k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device="cuda")
        cos = torch.randn(8192, head_dim, device="cuda")
        sin = torch.randn_like(cos)
        pos = torch.randint(8192, (num_tokens,), device="cuda")
        yield ("rotary", f"{num_tokens} tokens",
               lambda a=(pos, q, k, cos, sin): rotary_triton(*a),
               lambda a=(pos, q, k, cos, sin): rotary_torch(*a),
               2 * (q.numel() + k.numel()) * q.element_size())  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU: none found, nothing to time.")
        print("The kernels are still tested on the CPU: TRITON_INTERPRET=1 pytest tests/kernels")
        print("The C++ CPU kernels have their own benchmark: python bench/attention_cpu.py")
        return 0
    from triton.testing import do_bench

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    peak = copy_bandwidth(do_bench)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {peak / 1e9:.0f} GB/s, {args.dtype}")
    print(f"{'kernel':<20} {'shape':<28} {'triton ms':>10} {'torch ms':>10} {'speedup':>8} "
          f"{'GB/s':>7} {'of copy':>8}")  # fmt: skip
    for kernel, shape, triton_fn, torch_fn, nbytes in cases(dtype):
        t_ms = do_bench(triton_fn)
        r_ms = do_bench(torch_fn)
        gbps = nbytes / (t_ms * 1e-3) / 1e9
        print(f"{kernel:<20} {shape:<28} {t_ms:>10.4f} {r_ms:>10.4f} {r_ms / t_ms:>7.1f}x "
              f"{gbps:>7.0f} {gbps * 1e9 / peak:>7.0%}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
