"""oneDNN-prepacked linears give F.linear's numbers: fp32, and bf16 (native with AMX, else
widened to fp32)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_tiny_model

from engine import LLM, SamplingParams
from engine.model_loader import load_model
from engine.models.packed_linear import PackedLinear, prepack_supported, widens_bf16
from kernels.packed_linear import onednn_packs

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not prepack_supported(CPU, torch.float32), reason="this torch has no oneDNN prepacking"
)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@needs_onednn
def test_fp32_packed_linear_matches_f_linear():
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(5, 64, generator=gen)
    assert _rel_err(PackedLinear(w, b)(x), F.linear(x, w, b)) < 1e-6


@needs_onednn
def test_bf16_packed_linear_matches_f_linear():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(192, 576, generator=gen).to(torch.bfloat16)
    b = torch.randn(192, generator=gen).to(torch.bfloat16)
    x = torch.randn(7, 576, generator=gen).to(torch.bfloat16)
    linear = PackedLinear(w, b)
    out = linear(x)
    assert out.dtype == torch.bfloat16 and out.shape == (7, 192)
    # Against the exact products of the same bf16 values: one bf16 rounding of the output.
    exact = F.linear(x.double(), w.double(), b.double())
    assert _rel_err(out, exact) < 4e-3
    assert torch.equal(linear.weight, w)  # widening to fp32 loses nothing
    assert linear.compute_dtype == (torch.float32 if widens_bf16() else torch.bfloat16)


@needs_onednn
@pytest.mark.parametrize("widen", [True, False])
def test_a_bf16_linear_rounds_its_fp32_products_once(widen):
    """A bf16 product is fp32 sums of the bf16 values, rounded to bf16 once, widened or in
    oneDNN's bf16; an fp32 output (the LM head's logits) keeps the sums unrounded when widened
    (oneDNN's bf16 products come out in bf16: rounded once there too)."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    fp32_sums = F.linear(x.float(), w.float())
    linear = PackedLinear(w, widen=widen)
    # Where oneDNN has no bf16 layout (an AVX2 host) its products run widened all the same;
    # pagedq's GEMM (where this host measured it faster) takes bf16 there too.
    widen = widen or (linear.gemm == "onednn" and not onednn_packs(torch.bfloat16))
    assert linear.compute_dtype == (torch.float32 if widen else torch.bfloat16)
    out = linear(x)
    assert out.dtype == torch.bfloat16
    # One rounding to bf16 (8 significant bits) is within 2**-9 of each sum; allow 2**-8.
    assert torch.all((out.float() - fp32_sums).abs() <= fp32_sums.abs() * 2**-8 + 1e-6)
    logits = PackedLinear(w, out_dtype=torch.float32, widen=widen)(x)
    assert logits.dtype == torch.float32
    if widen:
        assert _rel_err(logits, fp32_sums) < 1e-6
    else:
        assert torch.all((logits - fp32_sums).abs() <= fp32_sums.abs() * 2**-8 + 1e-6)


@pytest.mark.parametrize("widen", [True, False])
def test_bf16_is_widened_where_the_host_measured_that_faster(tmp_path, monkeypatch, widen):
    from engine.dtype_probe import PROBE_VERSION, host_key, probe_cache_path

    monkeypatch.setenv("PAGEDQ_CACHE_DIR", str(tmp_path))
    path = probe_cache_path()
    path.parent.mkdir(parents=True)
    probe = {"float32_s": 0.1, "bfloat16_s": 0.05, "host": host_key(), "widen_bf16": widen}
    path.write_text(json.dumps({**probe, "version": PROBE_VERSION}))
    assert widens_bf16() == widen
    w = torch.randn(8, 16).to(torch.bfloat16)
    linear = PackedLinear(w)
    if widen:
        assert linear.compute_dtype == torch.float32
    elif linear.gemm == "onednn":  # bf16 products where oneDNN has a bf16 layout here
        assert linear.compute_dtype == (
            torch.bfloat16 if onednn_packs(torch.bfloat16) else torch.float32
        )


def test_fp32_and_bf16_are_prepacked_where_onednn_is(monkeypatch):
    onednn = prepack_supported(CPU, torch.float32)
    assert prepack_supported(CPU, torch.bfloat16) == onednn
    assert not prepack_supported(CPU, torch.float16)
    assert not prepack_supported(torch.device("meta"), torch.float32)
    monkeypatch.setenv("PAGEDQ_PREPACK", "0")
    assert not prepack_supported(CPU, torch.float32)
    assert not prepack_supported(CPU, torch.bfloat16)


@needs_onednn
def test_a_bf16_engine_runs_on_packed_weights(tmp_path, monkeypatch):
    """The engine packs a bf16 model, and its first token's logprobs match the plain model's."""
    folder = make_tiny_model(tmp_path / "llama", "llama")
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=5)

    def first_logprobs(llm):
        out = llm.generate([[1, 504, 3458, 282]], params, use_tqdm=False)[0].outputs[0]
        return out.logprobs[0]

    packed = LLM(str(folder), dtype="bfloat16", kv_cache_memory=2**22, block_size=16)
    model = packed.llm_engine.model
    assert isinstance(model.packed_lm_head, PackedLinear)
    assert isinstance(model.layers[0].self_attn.qkv_proj, PackedLinear)
    monkeypatch.setenv("PAGEDQ_PREPACK", "0")
    load_model.cache_clear()  # a fresh model: the cached one is already packed
    plain = LLM(str(folder), dtype="bfloat16", kv_cache_memory=2**22, block_size=16)
    assert plain.llm_engine.model.packed_lm_head is None
    got, expected = first_logprobs(packed), first_logprobs(plain)
    assert got.keys() == expected.keys()
    for token, logprob in expected.items():
        assert abs(got[token] - logprob) < 0.05
