"""Latent attention over a paged latent cache equals transformers' DeepseekV3Attention (the
expanded MHA) on tiny random weights: prefill chunks with cached context and decodes in one
varlen batch, yarn's mscale in the softmax scale, the q_lora path and the plain q_proj, both rope
layouts; the C++ and Triton (interpreter) kernels against the reference."""

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
)

from kernels.cpu_attention import cpu_kernels_available
from kernels.mla import (
    absorb_query,
    mla_attention,
    mla_attention_torch,
    project_output,
    split_kv_b_proj,
    write_latent,
    write_latent_torch,
)

needs_cpu = pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ kernels here")
BACKENDS = ["torch", pytest.param("cpu", marks=needs_cpu), "triton"]
BLOCK_SIZE = 4

CONFIGS = {
    # DeepSeek-V3's own shape of options: q through a LoRA, interleaved rope, yarn with mscale
    "q_lora-yarn-interleaved": dict(
        q_lora_rank=24,
        rope_interleave=True,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            mscale=1.0,
            mscale_all_dim=1.0,
            original_max_position_embeddings=32,
            beta_fast=32,
            beta_slow=1,
        ),
    ),  # fmt: skip
    "q_proj-default-rope": dict(q_lora_rank=None, rope_interleave=False),
}


def _attention(name: str) -> tuple[DeepseekV3Attention, DeepseekV3RotaryEmbedding]:
    config = DeepseekV3Config(
        hidden_size=48, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, max_position_embeddings=128,
        attn_implementation="eager", **CONFIGS[name],
    )  # fmt: skip
    torch.manual_seed(0)
    attn = DeepseekV3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() == 1 else 0.2) + (p.dim() == 1))
    return attn, DeepseekV3RotaryEmbedding(config)


def _hf_output(attn, rotary, hidden: torch.Tensor) -> torch.Tensor:
    """The expanded MHA of one whole sequence, causal: ``[S, hidden]``."""
    n = hidden.shape[0]
    cos_sin = rotary(hidden[None], torch.arange(n)[None])
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        return attn(hidden[None], cos_sin, mask)[0][0]


def _latent_inputs(attn, rotary, hidden, positions):
    """What a model runner computes before the kernel: the absorbed query parts and the latent
    row of each token (transformers' projections, norms and rope)."""
    cfg = attn.config
    with torch.no_grad():
        if attn.q_lora_rank is None:
            q = attn.q_proj(hidden)
        else:
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden)))
        q = q.view(hidden.shape[0], attn.num_heads, attn.qk_head_dim)
        q_nope, q_pe = q.split([attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        latent, k_pe = attn.kv_a_proj_with_mqa(hidden).split(
            [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1
        )
        latent = attn.kv_a_layernorm(latent)
        cos, sin = rotary(hidden[None], positions[None])
        rope = apply_rotary_pos_emb_interleave if cfg.rope_interleave else apply_rotary_pos_emb
        # [T, H, R] and [T, 1, R] as [1, ., T, R] for transformers' rope
        q_pe, k_pe = rope(q_pe.transpose(0, 1)[None], k_pe[None, None], cos, sin)
        w_uk, w_uv = split_kv_b_proj(
            attn.kv_b_proj.weight, attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim
        )
        return absorb_query(q_nope, w_uk), q_pe[0].transpose(0, 1), latent, k_pe[0, 0], w_uv


# Two sequences over three engine steps: a prefill split 7 + 3 then a decode, and a prefill of
# 4 then a decode; each step is one varlen call.
SEQ_LENS = [11, 5]
STEPS = [[(0, 7), (0, 4)], [(7, 10), (4, 5)], [(10, 11), None]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CONFIGS)
def test_matches_deepseek_v3_attention(name, backend):
    attn, rotary = _attention(name)
    gen = torch.Generator().manual_seed(1)
    hiddens = [torch.randn(n, attn.hidden_size, generator=gen) for n in SEQ_LENS]
    want = [_hf_output(attn, rotary, h) for h in hiddens]
    width = attn.kv_lora_rank + attn.qk_rope_head_dim
    num_blocks = 9
    latent_cache = torch.full((num_blocks, BLOCK_SIZE, width), float("nan"))
    # shuffled physical blocks per sequence: 3 for the 11-token one, 2 for the other
    block_table = torch.tensor([[7, 2, 5], [0, 8, -1]])
    got = [torch.empty_like(w) for w in want]
    for step in STEPS:
        rows = [(i, a, b) for i, span in enumerate(step) if span for a, b in [span]]
        parts = [_latent_inputs(attn, rotary, hiddens[i][a:b], torch.arange(a, b))
                 for i, a, b in rows]  # fmt: skip
        q_latent, q_pe, latent, k_pe = (torch.cat([p[j] for p in parts]) for j in range(4))
        positions = torch.cat([torch.arange(a, b) for _, a, b in rows])
        seqs = torch.cat([torch.full((b - a,), i) for i, a, b in rows])
        slot_mapping = block_table[seqs, positions // BLOCK_SIZE] * BLOCK_SIZE
        slot_mapping += positions % BLOCK_SIZE
        write_latent(latent, k_pe, latent_cache, slot_mapping, backend=backend)
        query_start_loc = torch.tensor([0] + [b - a for _, a, b in rows]).cumsum(0)
        seq_lens = torch.tensor([b for _, _, b in rows])
        table = block_table[[i for i, _, _ in rows]]
        out_latent = mla_attention(q_latent, q_pe, latent_cache, query_start_loc, seq_lens, table,
                                   attn.scaling, backend=backend)  # fmt: skip
        with torch.no_grad():
            out = attn.o_proj(project_output(out_latent, parts[0][4]).flatten(1))
        for (i, a, b), start in zip(rows, query_start_loc.tolist(), strict=False):
            got[i][a:b] = out[start : start + b - a]
    if name.startswith("q_lora"):
        assert attn.scaling != attn.qk_head_dim**-0.5  # yarn's mscale is in the scale
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def _random_cache_batch(gen, dtype, cache_dtype, rank=32, rope=16, heads=20):
    """Decodes and chunks over random cache contents; 20 heads: more than one block of 16."""
    q_lens, seq_lens = [1, 3, 1, 6], [9, 3, 30, 21]
    num_blocks = 34  # 32 used, shuffled
    cache = torch.randn(num_blocks, BLOCK_SIZE, rank + rope, generator=gen).to(cache_dtype)
    table = torch.randperm(num_blocks, generator=gen)[: 4 * 8].view(4, 8)
    n = sum(q_lens)
    q_latent = torch.randn(n, heads, rank, generator=gen).to(dtype)
    q_pe = torch.randn(n, heads, rope, generator=gen).to(dtype)
    loc = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    return q_latent, q_pe, cache, loc, torch.tensor(seq_lens, dtype=torch.int32), table


@pytest.mark.parametrize("backend", BACKENDS[1:])
@pytest.mark.parametrize(
    "dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                          (torch.float32, torch.bfloat16)],
)  # fmt: skip
def test_kernels_match_reference(backend, dtype, cache_dtype):
    gen = torch.Generator().manual_seed(2)
    q_latent, q_pe, cache, loc, seq_lens, table = _random_cache_batch(gen, dtype, cache_dtype)
    want = mla_attention_torch(q_latent, q_pe, cache, loc, seq_lens, table, 0.1)
    out = torch.full_like(q_latent, float("nan"))
    got = mla_attention(q_latent, q_pe, cache, loc, seq_lens, table, 0.1, out=out, backend=backend)
    assert got.data_ptr() == out.data_ptr()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_reference_against_float64():
    gen = torch.Generator().manual_seed(3)
    q_latent, q_pe, cache, loc, seq_lens, table = _random_cache_batch(gen, torch.float32,
                                                                      torch.float32)  # fmt: skip
    want = mla_attention_torch(q_latent.double(), q_pe.double(), cache.double(), loc, seq_lens,
                               table, 0.1)  # fmt: skip
    got = mla_attention_torch(q_latent, q_pe, cache, loc, seq_lens, table, 0.1)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS[1:])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_write_latent_matches_reference(backend, cache_dtype):
    """Bit for bit, bf16 rounding included; slots of -1 are skipped."""
    gen = torch.Generator().manual_seed(4)
    latent, k_pe = torch.randn(7, 32, generator=gen), torch.randn(7, 16, generator=gen)
    slots = torch.tensor([5, -1, 0, 17, 3, -1, 22])
    want = torch.zeros(6, BLOCK_SIZE, 48, dtype=cache_dtype)
    got = want.clone()
    write_latent_torch(latent, k_pe, want, slots)
    write_latent(latent, k_pe, got, slots, backend=backend)
    assert torch.equal(got, want)
    assert want.abs().sum() > 0
