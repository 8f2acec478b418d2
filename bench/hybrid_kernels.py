"""The recurrent-state and latent-attention kernels on the CPU: torch reference against C++.

    python bench/hybrid_kernels.py [--repeats 5]

Shapes of the real models' layers: a Qwen3.5 Gated DeltaNet layer (16 key heads, 32 value
heads, 128 x 128 states; conv over 8,192 channels, kernel 4), a Kimi Linear KDA layer (32 heads,
128 x 128 states, a decay per key channel), a Granite 4.0-H Mamba-2 layer (48 heads of 64, one
group, 128-wide states) and a DeepSeek-V3 latent layer (kv_lora_rank 512, rope 64, 16 heads: one
tensor-parallel shard of 128). Each case runs both
backends in alternating rounds (so a noisy host hits them alike) and prints the best time of
each and the ratio reference / C++.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.causal_conv1d import causal_conv1d_cpu, causal_conv1d_torch  # noqa: E402
from kernels.cpu_attention import cpu_kernels_available  # noqa: E402
from kernels.gated_delta import (  # noqa: E402
    gated_delta_rule_chunked_torch,
    gated_delta_rule_cpu,
    gated_delta_rule_recurrent_torch,
)
from kernels.kimi_delta import (  # noqa: E402
    kimi_delta_rule_chunked_torch,
    kimi_delta_rule_cpu,
    kimi_delta_rule_recurrent_torch,
)
from kernels.mamba_ssm import (  # noqa: E402
    mamba_chunk_scan_chunked_torch,
    mamba_chunk_scan_cpu,
    mamba_chunk_scan_recurrent_torch,
)
from kernels.mla import mla_attention_cpu, mla_attention_torch  # noqa: E402

HK, HV, K, V, CONV_DIM = 16, 32, 128, 128, 8192
RANK, ROPE, HEADS, BLOCK = 512, 64, 16, 16
KDA_HEADS = 32
SSM_HEADS, SSM_P, SSM_N = 48, 64, 128


def _race(label: str, reference, cpp, repeats: int) -> None:
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, fn in enumerate((reference, cpp)):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    ratio = best[0] / best[1]
    print(
        f"{label:48s} torch {best[0] * 1e3:9.2f} ms   C++ {best[1] * 1e3:8.2f} ms   {ratio:5.1f}x"
    )


def _delta_inputs(num_tokens: int, dtype: torch.dtype):
    q, k = torch.randn(2, num_tokens, HK, K).to(dtype)
    v = torch.randn(num_tokens, HV, V).to(dtype)
    return q, k, v, -torch.rand(num_tokens, HV) * 0.3, torch.rand(num_tokens, HV)


def _kda_inputs(num_tokens: int):
    q, k, v = torch.randn(3, num_tokens, KDA_HEADS, K)
    return q, k, v, -torch.rand(num_tokens, KDA_HEADS, K) * 0.3, torch.rand(num_tokens, KDA_HEADS)


def _ssm_inputs(num_tokens: int):
    x = torch.randn(num_tokens, SSM_HEADS, SSM_P)
    dt, b, c = torch.randn(num_tokens, SSM_HEADS), *torch.randn(2, num_tokens, 1, SSM_N)
    a, d, dt_bias = -torch.rand(SSM_HEADS) - 0.5, torch.ones(SSM_HEADS), torch.zeros(SSM_HEADS)
    return x, dt, a, b, c, d, dt_bias


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not cpu_kernels_available():
        sys.exit("the C++ kernels cannot be built here")
    torch.manual_seed(0)
    n = args.repeats
    batch = 32
    pool = torch.randn(batch + 1, HV, K, V) * 0.1
    decode = (torch.arange(batch + 1), torch.arange(1, batch + 1))
    for dtype in (torch.float32, torch.bfloat16):
        x = _delta_inputs(batch, dtype)
        _race(f"gated delta, {batch} decodes, {str(dtype)[6:]}",
              lambda x=x: gated_delta_rule_recurrent_torch(*x, pool, *decode),
              lambda x=x: gated_delta_rule_cpu(*x, pool, *decode), n)  # fmt: skip
    prompt = (torch.tensor([0, 512]), torch.tensor([1]))
    x = _delta_inputs(512, torch.float32)
    _race("gated delta, one 512-token chunk (torch chunked)",
          lambda: gated_delta_rule_chunked_torch(*x, pool, *prompt),
          lambda: gated_delta_rule_cpu(*x, pool, *prompt), max(1, n // 2))  # fmt: skip
    kda_pool = torch.randn(batch + 1, KDA_HEADS, K, V) * 0.1
    ssm_pool = torch.randn(batch + 1, SSM_HEADS, SSM_P, SSM_N) * 0.1
    cases = (
        ("KDA", _kda_inputs, kda_pool, kimi_delta_rule_recurrent_torch,
         kimi_delta_rule_chunked_torch, kimi_delta_rule_cpu),
        ("Mamba-2 scan", _ssm_inputs, ssm_pool, mamba_chunk_scan_recurrent_torch,
         mamba_chunk_scan_chunked_torch, mamba_chunk_scan_cpu),
    )  # fmt: skip
    for name, inputs, state, recurrent, chunked, cpp in cases:
        x = inputs(batch)
        _race(f"{name}, {batch} decodes, float32",
              lambda x=x, s=state, f=recurrent: f(*x, s, *decode),
              lambda x=x, s=state, f=cpp: f(*x, s, *decode), n)  # fmt: skip
        x = inputs(512)
        _race(f"{name}, one 512-token chunk (torch chunked)",
              lambda x=x, s=state, f=chunked: f(*x, s, *prompt),
              lambda x=x, s=state, f=cpp: f(*x, s, *prompt), max(1, n // 2))  # fmt: skip
    weight, conv_pool = torch.randn(CONV_DIM, 4), torch.randn(batch + 1, CONV_DIM, 3)
    for tokens, meta in ((batch, decode), (512, prompt)):
        xs = torch.randn(tokens, CONV_DIM)
        _race(f"causal conv1d, {tokens} tokens",
              lambda xs=xs, meta=meta: causal_conv1d_torch(xs, weight, None, conv_pool, *meta),
              lambda xs=xs, meta=meta: causal_conv1d_cpu(xs, weight, None, conv_pool, *meta),
              n)  # fmt: skip
    seqs, context = 16, 1024
    num_blocks = seqs * context // BLOCK
    table = torch.randperm(num_blocks).view(seqs, -1)
    q_latent, q_pe = torch.randn(seqs, HEADS, RANK), torch.randn(seqs, HEADS, ROPE)
    meta = (torch.arange(seqs + 1), torch.full((seqs,), context), table)
    for cache_dtype in (torch.float32, torch.bfloat16):
        cache = torch.randn(num_blocks, BLOCK, RANK + ROPE).to(cache_dtype)
        _race(f"MLA, {seqs} decodes x {context}, {str(cache_dtype)[6:]} cache",
              lambda c=cache: mla_attention_torch(q_latent, q_pe, c, *meta, 0.1),
              lambda c=cache: mla_attention_cpu(q_latent, q_pe, c, *meta, 0.1), n)  # fmt: skip
    cache = torch.randn(num_blocks, BLOCK, RANK + ROPE)
    q_latent, q_pe = torch.randn(256, HEADS, RANK), torch.randn(256, HEADS, ROPE)
    chunk = (q_latent, q_pe, cache, torch.tensor([0, 256]), torch.tensor([context]), table[:1])
    _race(f"MLA, a 256-token chunk at {context}",
          lambda: mla_attention_torch(*chunk, 0.1),
          lambda: mla_attention_cpu(*chunk, 0.1), max(1, n // 2))  # fmt: skip


if __name__ == "__main__":
    main()
