"""pagedq's own GEMM (kernels/csrc/linear_cpu.cpp) computes x @ W.T + b as a linear does: fp32
to fp32's accuracy, bf16 as fp32 sums rounded to bf16 once (an fp32 output: not rounded); every
tail of its blocks covered."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_tiny_model

from engine import LLM, SamplingParams
from engine.models.packed_linear import PackedLinear
from kernels.cpu_linear import (
    pack_linear_weight,
    packed_linear,
    packed_linear_available,
    unpack_linear_weight,
)

fp32, bf16 = torch.float32, torch.bfloat16


def needs(dtype: torch.dtype):
    return pytest.mark.skipif(
        not packed_linear_available(dtype), reason=f"no pagedq GEMM for {dtype} in this build"
    )


# (tokens, out_features, in_features): a decode row, one micro-kernel's rows and its remainder,
# column blocks with a tail (out not a multiple of 64), odd in_features (a bf16 pair padded),
# more rows than one pass over the weights (192), the default model's shapes.
SHAPES = [
    (1, 64, 16),
    (6, 128, 32),
    (7, 100, 33),
    (5, 70, 65),
    (13, 960, 576),
    (200, 576, 1536),
    (401, 192, 96),
]


def _weights(out_features, in_features, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen)
    return w, b, gen


@needs(fp32)
@pytest.mark.parametrize(("tokens", "out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_fp32_matches_f_linear(tokens, out_features, in_features, with_bias):
    w, b, gen = _weights(out_features, in_features, fp32, tokens)
    b = b if with_bias else None
    x = torch.randn(tokens, in_features, generator=gen)
    out = packed_linear(x, pack_linear_weight(w), out_features, b)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.dtype == fp32 and out.shape == (tokens, out_features)
    # fp32 sums in another order: within a few ulps of the sum of magnitudes.
    scale = F.linear(x.double().abs(), w.double().abs()) + 1
    assert torch.all((out.double() - exact).abs() <= scale * 2**-20)


@needs(bf16)
@pytest.mark.parametrize(("tokens", "out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_bf16_is_fp32_sums_rounded_once(tokens, out_features, in_features, with_bias):
    w, b, gen = _weights(out_features, in_features, bf16, tokens)
    b = b if with_bias else None
    x = torch.randn(tokens, in_features, generator=gen).to(bf16)
    packed = pack_linear_weight(w)
    out = packed_linear(x, packed, out_features, b)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.dtype == bf16 and out.shape == (tokens, out_features)
    # One rounding to bf16 (8 significant bits) is within 2**-9 of each sum; the fp32 sums
    # themselves are within a few ulps of the sum of magnitudes.
    scale = F.linear(x.double().abs(), w.double().abs()) + 1
    assert torch.all((out.double() - exact).abs() <= exact.abs() * 2**-8 + scale * 2**-20)
    # fp32 logits of a bf16 model are the same fp32 sums, not rounded: no bf16 ties.
    logits = packed_linear(x, packed, out_features, b, fp32)
    assert logits.dtype == fp32 and torch.equal(logits.to(bf16), out)
    assert torch.all((logits.double() - exact).abs() <= scale * 2**-20)
    assert not torch.equal(logits, out.float())


@pytest.mark.parametrize("dtype", [fp32, bf16])
def test_the_packed_weight_unpacks_to_the_same_values(dtype):
    if not packed_linear_available(dtype):
        pytest.skip(f"no pagedq GEMM for {dtype} in this build")
    w, _, _ = _weights(70, 65, dtype, 0)
    packed = pack_linear_weight(w)
    assert torch.equal(unpack_linear_weight(packed, 70, 65), w)
    assert torch.equal(PackedLinear(w, gemm="pagedq", widen=False).weight, w)


@needs(fp32)
def test_leading_dims_and_strided_rows_are_accepted():
    w, b, gen = _weights(96, 64, fp32, 3)
    x = torch.randn(2, 3, 128, generator=gen)[..., ::2]  # rows with a stride of 2
    out = packed_linear(x, pack_linear_weight(w), 96, b)
    assert out.shape == (2, 3, 96)
    assert torch.allclose(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [fp32, bf16])
def test_packed_linear_follows_the_measured_gemm(tmp_path, monkeypatch, dtype):
    """The probe's choice of GEMM reaches every PackedLinear; PAGEDQ_GEMM overrides it."""
    from engine.dtype_probe import PROBE_VERSION, host_key, probe_cache_path

    monkeypatch.setenv("PAGEDQ_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PAGEDQ_GEMM", raising=False)
    path = probe_cache_path()
    path.parent.mkdir(parents=True)
    probe = {"float32_s": 0.1, "bfloat16_s": 0.05, "host": host_key(), "version": PROBE_VERSION}
    path.write_text(json.dumps({**probe, "gemm_fp32": "pagedq", "gemm_bf16": "pagedq"}))
    w = torch.randn(64, 32).to(dtype)
    expected = "pagedq" if packed_linear_available(dtype) else "onednn"
    assert PackedLinear(w, widen=False).gemm == expected
    monkeypatch.setenv("PAGEDQ_GEMM", "onednn")
    assert PackedLinear(w, widen=False).gemm == "onednn"
    with pytest.raises(ValueError, match="gemm='mkl' is not supported: must be one of"):
        PackedLinear(w, widen=False, gemm="mkl")
    monkeypatch.setenv("PAGEDQ_GEMM", "mkl")
    with pytest.raises(ValueError, match="PAGEDQ_GEMM='mkl' is not supported: must be one of"):
        PackedLinear(w, widen=False)


@needs(fp32)
def test_an_fp32_engine_on_pagedq_gemm_gives_onednn_tokens(tmp_path, monkeypatch):
    """A tiny Qwen2 (qkv bias, odd sizes padded into blocks) greedy-decodes the same tokens on
    either GEMM."""
    folder = make_tiny_model(tmp_path / "qwen2", "qwen2")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 504, 3458, 282], [7, 8, 9, 10, 11, 12, 13]]
    tokens = {}
    for gemm in ("onednn", "pagedq"):
        monkeypatch.setenv("PAGEDQ_GEMM", gemm)
        from engine.model_loader import load_model

        load_model.cache_clear()
        llm = LLM(str(folder), dtype="float32", kv_cache_memory=2**22, block_size=16)
        assert llm.llm_engine.model.layers[0].self_attn.qkv_proj.gemm == gemm
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[gemm] = [o.outputs[0].token_ids for o in outs]
    assert tokens["pagedq"] == tokens["onednn"]


@pytest.mark.parametrize("dtype", [fp32, bf16])
@pytest.mark.parametrize(
    ("tokens", "intermediate", "in_features", "with_bias"),
    [(1, 64, 576, True), (7, 128, 33, True), (64, 1536, 576, False), (401, 192, 96, True)],
)
def test_fused_silu_and_mul_gives_the_unfused_bits(
    dtype, tokens, intermediate, in_features, with_bias
):
    """gate_up's GEMM with silu_and_mul in its epilogue equals the GEMM and then the C++
    silu_and_mul, bit for bit (rounded gate and up values, the same exp)."""
    if not packed_linear_available(dtype):
        pytest.skip(f"no pagedq GEMM for {dtype} in this build")
    from kernels import silu_and_mul
    from kernels.cpu_linear import packed_linear_silu_mul

    w, b, gen = _weights(2 * intermediate, in_features, dtype, tokens)
    b = b if with_bias else None
    x = torch.randn(tokens, in_features, generator=gen).to(dtype)
    packed = pack_linear_weight(w)
    unfused = silu_and_mul(packed_linear(x, packed, 2 * intermediate, b), backend="cpu")
    fused = packed_linear_silu_mul(x, packed, intermediate, b)
    assert fused.dtype == dtype and torch.equal(fused, unfused)
    linear = PackedLinear(w, b, gemm="pagedq", widen=False)
    assert linear.fuses_silu_and_mul
    assert torch.equal(linear.silu_and_mul(x), silu_and_mul(linear(x), backend="cpu"))


@needs(fp32)
def test_gate_up_without_whole_blocks_is_not_fused():
    linear = PackedLinear(torch.randn(2 * 40, 16), gemm="pagedq")
    assert not linear.fuses_silu_and_mul
    with pytest.raises(RuntimeError, match="a multiple of 64"):
        linear.silu_and_mul(torch.randn(2, 16))


@pytest.mark.parametrize("dtype", [fp32, bf16])
@pytest.mark.parametrize(("tokens", "vocab"), [(1, 1000), (7, 49152), (64, 576), (192, 130)])
def test_argmax_in_the_gemm_is_torch_argmax_of_the_logits(dtype, tokens, vocab):
    """The LM head's fused argmax ranks the logits the unfused path writes: the same index per
    row, ties to the first, NaN above everything (its first)."""
    if not packed_linear_available(dtype):
        pytest.skip(f"no pagedq GEMM for {dtype} in this build")
    from kernels.cpu_linear import packed_linear_argmax

    w, _, gen = _weights(vocab, 48, dtype, tokens)
    w[vocab - 3] = w[vocab // 2]  # two columns tie on every row: the first must win
    w[5] = w[vocab - 1]
    x = torch.randn(tokens, 48, generator=gen).to(dtype)
    x[0] *= 8  # one row whose tied columns are its largest
    packed = pack_linear_weight(w)
    logits = packed_linear(x, packed, vocab, None, fp32)
    assert torch.equal(packed_linear_argmax(x, packed, vocab), logits.argmax(-1))
    head = PackedLinear(w, out_dtype=fp32, gemm="pagedq", widen=False)
    assert head.fuses_argmax(tokens) and not head.fuses_argmax(193)
    assert torch.equal(head.argmax(x), head(x).argmax(-1))


@needs(fp32)
def test_argmax_ties_and_nan_across_the_threads_runs():
    """Equal maxima in columns that two threads compute go to the lower column; a NaN logit
    wins wherever it is, the first one if several."""
    from kernels.cpu_linear import packed_linear_argmax

    vocab = 640  # 10 blocks, 5 per thread
    w = torch.zeros(vocab, 4)
    w[:, 0] = -1.0
    w[100, 0] = w[600, 0] = 2.0  # a tie between the first and the second thread's columns
    # Row 2: column 630's products overflow to +inf and -inf, whose sum is NaN; it beats the
    # first thread's maximum. Row 1 is NaN everywhere: its first column.
    w[630, 1], w[630, 3] = 3e38, -3e38
    x = torch.tensor([[1.0, 0, 0, 0], [float("nan"), 0, 0, 0], [1.0, 2.0, 0, 2.0]])
    packed = pack_linear_weight(w)
    got = packed_linear_argmax(x, packed, vocab)
    expected = F.linear(x, w).argmax(-1)
    assert got.tolist() == expected.tolist() == [100, 0, 630]


@pytest.mark.parametrize("gemm", ["onednn", "pagedq"])
def test_a_greedy_engine_gives_the_same_tokens_with_the_argmax_fused(tmp_path, monkeypatch, gemm):
    """Plain greedy batches take the LM head's fused argmax on pagedq's GEMM; the tokens equal
    those of the logits path (logprobs=0 forces it) request by request."""
    if gemm == "pagedq" and not packed_linear_available(bf16):
        pytest.skip("no pagedq bf16 GEMM in this build")
    from engine.model_loader import load_model

    monkeypatch.setenv("PAGEDQ_GEMM", gemm)
    load_model.cache_clear()
    folder = make_tiny_model(tmp_path / "llama", "llama")
    llm = LLM(str(folder), dtype="bfloat16", kv_cache_memory=2**22, block_size=16)
    assert llm.llm_engine.model.packed_lm_head.fuses_argmax(4) == (gemm == "pagedq")
    prompts = [[1, 504, 3458, 282], [7, 8, 9, 10, 11, 12, 13], [42] * 9]
    fused = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    logits = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=10, logprobs=0), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in fused] == [o.outputs[0].token_ids for o in logits]


def _amx_here() -> bool:
    from kernels.cpu_attention import amx_decode_available, cpu_kernels_available

    return cpu_kernels_available() and amx_decode_available() and packed_linear_available(bf16)


@pytest.mark.skipif(not _amx_here(), reason="no AMX here (or PAGEDQ_CPU_AMX=0)")
@pytest.mark.parametrize("tokens", [32, 64, 77])
def test_amx_rows_give_the_fp32_sums_and_the_argmax(tokens, monkeypatch):
    """bf16 products of 32 rows or more run whole groups of 32 rows on AMX tiles (77: two
    groups and a tail on the micro-kernels): the LM head's fp32 logits are the fp32 sums as the
    AVX path's are, a bf16 output is them rounded once, the fused argmax ranks them, and a
    fused SiLU-and-mul gives the unfused bits."""
    from kernels import silu_and_mul
    from kernels.cpu_linear import packed_linear_argmax, packed_linear_silu_mul

    w, _, gen = _weights(1000, 576, bf16, tokens)
    x = torch.randn(tokens, 576, generator=gen).to(bf16)
    packed = pack_linear_weight(w)
    logits = packed_linear(x, packed, 1000, None, fp32)
    exact = F.linear(x.double(), w.double())
    scale = F.linear(x.double().abs(), w.double().abs()) + 1
    assert torch.all((logits.double() - exact).abs() <= scale * 2**-20)
    assert torch.equal(packed_linear(x, packed, 1000), logits.to(bf16))
    assert torch.equal(packed_linear_argmax(x, packed, 1000), logits.argmax(-1))
    gate_up = pack_linear_weight(w[:512])
    unfused = silu_and_mul(packed_linear(x, gate_up, 512), backend="cpu")
    assert torch.equal(packed_linear_silu_mul(x, gate_up, 256), unfused)
    monkeypatch.setenv("PAGEDQ_CPU_AMX", "0")
    avx = packed_linear(x, packed, 1000, None, fp32)
    assert torch.all((avx.double() - exact).abs() <= scale * 2**-20)
    assert not torch.equal(logits[:32], avx[:32])  # the tile path ran (another summing order)
