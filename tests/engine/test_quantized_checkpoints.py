"""The quantized-checkpoint writers against the upstream layouts, independently of pagedq:
vLLM's own unpacking (GPTQ `pack_rows`/`unpack_cols`, AWQ's reverse order in awq_triton.py),
compressed-tensors' own decompressors and AutoAWQ converter, and transformers' own loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quantized_checkpoints import write_awq, write_compressed_tensors, write_gptq
from safetensors.torch import load_file
from tiny_models import tiny_hf_model

AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # vLLM awq_triton.py
MOE = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """model type -> (HF model, its own save_pretrained tensors: checkpoint names, fp32)."""
    out = {}
    for model_type in ("llama", "qwen3_moe", "mixtral"):
        # A small vocabulary keeps the folders small: no text is generated from them here.
        model = tiny_hf_model(model_type, vocab_size=512, **MOE.get(model_type, {}))
        folder = tmp_path_factory.mktemp(f"{model_type}-float")
        model.save_pretrained(folder)
        out[model_type] = model, load_file(folder / "model.safetensors")
    return out


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """vLLM's unpack: value i of each int32 in bits [bits*i, bits*(i+1)), along `dim`."""
    shifts = torch.arange(0, 32, bits)
    if dim == 0:  # [K/pf, N] -> [K, N]
        vals = (packed[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
        return vals.reshape(-1, packed.shape[1])
    vals = (packed[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)
    return vals.reshape(packed.shape[0], -1)


def read(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def quantized_modules(tensors: dict, suffix: str) -> list[str]:
    return sorted(k.removesuffix(suffix) for k in tensors if k.endswith(suffix))


def check_reference(ref: dict, float_tensors: dict, steps: dict) -> None:
    """Every tensor of the float model is in the reference; quantized weights are within
    `steps[module]` (per element) of the float ones, all others equal up to storage dtype."""
    assert set(ref) == set(float_tensors)
    for key, original in float_tensors.items():
        module = key.removesuffix(".weight")
        if module in steps:
            assert (ref[key] - original).abs().le(steps[module] * 1.001).all(), key
        else:
            assert torch.allclose(ref[key], original, rtol=1e-2, atol=1e-3), key


def check_hf_loads(ref_dir: Path, tmp_path: Path) -> None:
    """transformers loads the reference with nothing missing, and holds exactly its tensors."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        ref_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    model.save_pretrained(tmp_path / "resaved")
    resaved, ref = read(tmp_path / "resaved"), read(ref_dir)
    assert resaved.keys() == ref.keys()
    assert all(torch.equal(resaved[k], ref[k]) for k in ref)


def check_folder(folder: Path, dtype: str, quant_method: str | None) -> dict:
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == dtype
    assert config.get("quantization_config", {}).get("quant_method") == quant_method
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (folder / name).exists(), name
    return config


@pytest.mark.parametrize(
    "bits, group_size, sym, desc_act, fmt",
    [
        (4, 32, True, False, "gptq"),
        (4, 32, False, True, "gptq"),
        (4, 32, False, False, "gptq_v2"),
        (8, -1, True, True, "gptq_v2"),
    ],
)
def test_gptq_layout(models, tmp_path, bits, group_size, sym, desc_act, fmt):
    model, float_tensors = models["llama"]
    write_gptq(model, tmp_path / "q", tmp_path / "r", bits, group_size, sym, desc_act, fmt)
    q, ref = read(tmp_path / "q"), read(tmp_path / "r")
    config = check_folder(tmp_path / "q", "float16", "gptq")["quantization_config"]
    assert config == {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "lm_head": False,
        "checkpoint_format": fmt,
        "pack_dtype": "int32",
        "true_sequential": True,
        "damp_percent": 0.01,
        "static_groups": False,
        "meta": {"quantizer": ["gptqmodel:2.2.0"]},
    }
    check_folder(tmp_path / "r", "float32", None)
    modules = quantized_modules(q, ".qweight")
    assert len(modules) == 2 * 7 and not any("lm_head" in m or "embed" in m for m in modules)
    steps = {}
    for m in modules:
        n, k = float_tensors[f"{m}.weight"].shape
        groups = 1 if group_size == -1 else k // group_size
        assert q[f"{m}.qweight"].shape == (k * bits // 32, n)
        assert q[f"{m}.qweight"].dtype == q[f"{m}.qzeros"].dtype == torch.int32
        assert q[f"{m}.qzeros"].shape == (groups, n * bits // 32)
        assert q[f"{m}.scales"].shape == (groups, n) and q[f"{m}.scales"].dtype == torch.float16
        g_idx = q[f"{m}.g_idx"]
        assert g_idx.dtype == torch.int32 and g_idx.shape == (k,)
        assert g_idx.bincount().tolist() == [k // groups] * groups
        assert bool((g_idx.diff() < 0).any()) == (desc_act and groups > 1)  # act order
        zeros = unpack(q[f"{m}.qzeros"], bits, 1) + (1 if fmt == "gptq" else 0)
        if sym:
            assert (zeros == 2 ** (bits - 1)).all()
        scales = q[f"{m}.scales"].float()
        weight = (unpack(q[f"{m}.qweight"], bits, 0) - zeros[g_idx]) * scales[g_idx]
        assert torch.equal(weight.T, ref[f"{m}.weight"]), m
        steps[m] = scales[g_idx].T
    check_reference(ref, float_tensors, steps)
    if not desc_act and bits == 4 and sym:
        check_hf_loads(tmp_path / "r", tmp_path)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_awq_layout(models, tmp_path, model_type):
    model, float_tensors = models[model_type]
    write_awq(model, tmp_path / "q", tmp_path / "r", group_size=32)
    q, ref = read(tmp_path / "q"), read(tmp_path / "r")
    config = check_folder(tmp_path / "q", "float16", "awq")["quantization_config"]
    assert config == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 32,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    steps = {}
    for m in quantized_modules(q, ".qweight"):
        n, k = float_tensors[f"{m}.weight"].shape
        assert q[f"{m}.qweight"].shape == (k, n // 8)
        assert q[f"{m}.qzeros"].shape == (k // 32, n // 8)
        assert q[f"{m}.qweight"].dtype == q[f"{m}.qzeros"].dtype == torch.int32
        assert q[f"{m}.scales"].shape == (k // 32, n) and q[f"{m}.scales"].dtype == torch.float16

        def awq_unpack(packed):  # vLLM awq_triton: shifts = AWQ_REVERSE_ORDER * 4
            vals = unpack(packed, 4, 1).reshape(packed.shape[0], -1, 8)
            return vals[..., AWQ_REVERSE_ORDER].reshape(packed.shape[0], -1)

        group = torch.arange(k) // 32
        scales = q[f"{m}.scales"].float()[group]
        weight = (awq_unpack(q[f"{m}.qweight"]) - awq_unpack(q[f"{m}.qzeros"])[group]) * scales
        assert torch.equal(weight.T, ref[f"{m}.weight"]), m
        steps[m] = scales.T
    check_reference(ref, float_tensors, steps)
    if model_type == "qwen3_moe":
        assert_moe_names(q, "mlp.experts.{e}.{p}.qweight", ("gate_proj", "up_proj", "down_proj"))
        assert q["model.layers.0.mlp.gate.weight"].dtype == torch.float16  # router: as is
        check_hf_loads(tmp_path / "r", tmp_path)


def assert_moe_names(tensors: dict, pattern: str, projections: tuple[str, ...]) -> None:
    """Per-expert 2-D tensors as the hub's MoE checkpoints name them; no fused 3-D ones."""
    for layer in range(2):
        for e in range(4):
            for p in projections:
                assert f"model.layers.{layer}." + pattern.format(e=e, p=p) in tensors
    assert not any("gate_up_proj" in k or k.endswith("experts.down_proj") for k in tensors)


def test_awq_matches_compressed_tensors_converter(models, tmp_path):
    """compressed-tensors' AutoAWQ converter, then its decompressor, gives the reference."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    write_awq(models["llama"][0], tmp_path / "q", tmp_path / "r", group_size=32)
    q, ref = read(tmp_path / "q"), read(tmp_path / "r")
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]

    converter = AutoAWQConverter.from_autoawq_config(config)
    converted = converter.process(dict(q))
    (scheme,) = converter.update_config(None).config_groups.values()
    modules = quantized_modules(converted, ".weight_packed")
    assert modules == quantized_modules(q, ".qweight")
    for m in modules:
        names = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
        state = {n: converted[f"{m}.{n}"] for n in names}
        state["weight_scale"] = state["weight_scale"].float()  # fp32 math: exact
        weight = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
        assert torch.equal(weight, ref[f"{m}.weight"]), m


CT_CASES = [
    ("llama", dict(scheme="w4a16")),
    ("qwen3_moe", dict(scheme="w4a16", symmetric=False)),
    ("llama", dict(scheme="w4a16", symmetric=False, strategy="channel")),
    ("llama", dict(scheme="w8a8-int8")),
    ("qwen3_moe", dict(scheme="w8a8-int8", dynamic=False)),
    ("mixtral", dict(scheme="w8a8-fp8")),
    ("llama", dict(scheme="w8a8-fp8", strategy="tensor", dynamic=False)),
]


@pytest.mark.parametrize("model_type, options", CT_CASES)
def test_compressed_tensors_layout(models, tmp_path, model_type, options):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer,
    )
    from compressed_tensors.quantization import QuantizationConfig

    model, float_tensors = models[model_type]
    write_compressed_tensors(model, tmp_path / "q", tmp_path / "r", **options)
    q, ref = read(tmp_path / "q"), read(tmp_path / "r")
    raw = check_folder(tmp_path / "q", "bfloat16", "compressed-tensors")["quantization_config"]
    config = QuantizationConfig.model_validate(raw)
    scheme, strategy = options["scheme"], options.get("strategy")
    fmt = {"w4a16": "pack-quantized", "w8a8-int8": "int-quantized", "w8a8-fp8": "float-quantized"}
    assert raw["format"] == fmt[scheme] and raw["quantization_status"] == "compressed"
    routers = [k.removesuffix(".weight") for k in q if k.endswith("gate.weight")]
    assert raw["ignore"][0] == "lm_head" and sorted(raw["ignore"][1:]) == sorted(routers)
    (group,) = config.config_groups.values()
    assert group.targets == ["Linear"] and group.format == fmt[scheme]
    assert group.weights.strategy == (strategy or ("group" if scheme == "w4a16" else "channel"))
    if scheme != "w4a16":
        dynamic = options.get("dynamic", True)
        acts = group.input_activations
        assert (acts.strategy, acts.dynamic) == (("token", True) if dynamic else ("tensor", False))

    key = "weight_packed" if scheme == "w4a16" else "weight_scale"
    modules = quantized_modules(q, f".{key}")
    assert modules and not any("lm_head" in m or m.endswith("gate") for m in modules)
    steps = {}
    for m in modules:
        n, k = float_tensors[f"{m}.weight"].shape
        scale = q[f"{m}.weight_scale"]
        assert scale.dtype == torch.bfloat16
        if scheme == "w4a16":
            groups = k // 32 if (strategy or "group") == "group" else 1
            assert q[f"{m}.weight_packed"].shape == (n, k // 8)
            assert q[f"{m}.weight_shape"].tolist() == [n, k] and scale.shape == (n, groups)
            zp_key = f"{m}.weight_zero_point"
            assert (zp_key in q) == (not options.get("symmetric", True))
            if zp_key in q:
                assert q[zp_key].shape == (n // 8, groups) and q[zp_key].dtype == torch.int32
            steps[m] = scale.float().repeat_interleave(k // groups, dim=1)
        else:
            dtype = torch.int8 if scheme == "w8a8-int8" else torch.float8_e4m3fn
            assert q[f"{m}.weight"].dtype == dtype and q[f"{m}.weight"].shape == (n, k)
            assert scale.shape == ((1,) if strategy == "tensor" else (n, 1))
            assert (f"{m}.input_scale" in q) == (not options.get("dynamic", True))
            if scheme == "w8a8-int8":
                steps[m] = scale.float().expand(n, k)
            else:  # e4m3: 3 mantissa bits, so half an ulp is 1/16 of the value
                steps[m] = float_tensors[f"{m}.weight"].abs() / 16 + scale.float() / 64
    # compressed-tensors' own model-free dequantizer; fp32 scales make its math exact.
    dequantizer = CompressedTensorsDequantizer(
        tmp_path / "q", ignore=["model.embed_tokens"], dtype=torch.float32
    )
    out = dequantizer.process({k: v.float() if k.endswith("_scale") else v for k, v in q.items()})
    for m in modules:
        assert torch.equal(out[f"{m}.weight"], ref[f"{m}.weight"]), m
    check_reference(ref, float_tensors, steps)
    if model_type == "mixtral":
        assert_moe_names(q, "block_sparse_moe.experts.{e}.{p}.weight", ("w1", "w2", "w3"))
        check_hf_loads(tmp_path / "r", tmp_path)
    if not options.get("dynamic", True):
        assert_input_scales(model, q, modules, 127.5 if scheme == "w8a8-int8" else 448.0)


def assert_input_scales(model, q: dict, modules: list[str], top: float) -> None:
    """Static input scales: one bf16 [1] per linear, per expert too; q_proj's is its input's
    absolute max over the calibration batch / `top`, as a forward hook on it sees it."""
    for m in modules:
        assert q[f"{m}.input_scale"].shape == (1,) and q[f"{m}.input_scale"].item() > 0
    experts = [q[f"{m}.input_scale"].item() for m in modules if "experts" in m]
    assert not experts or len(set(experts)) > 2  # observed per expert, not one fallback
    seen = []
    q_proj = model.model.layers[0].self_attn.q_proj
    handle = q_proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0].abs().max()))
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(vocab, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    expected = (seen[0] / top).to(torch.bfloat16)
    assert torch.equal(q["model.layers.0.self_attn.q_proj.input_scale"], expected.reshape(1))
