"""Quantized checkpoints (MXFP4, block FP8), quantized here by each format's definition, load
with the weights transformers dequantizes them to and generate Hugging Face's greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model

from engine.model_loader import ModelSource, iter_weights, load_config
from engine.models.quantized_weights import FP4_E2M1, dequantize_mxfp4, dequantized
from tests.engine.test_architectures import GREEDY, PROMPTS, hf_greedy, one_thread, tiny_llm  # noqa: F401

E2M1 = torch.tensor(FP4_E2M1[:8])  # the non-negative half; bit 3 is the sign


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX: per block of 32 along the last dim, a shared exponent floor(log2(amax)) - 2
    (E2M1's largest exponent), elements rounded to the nearest E2M1 value; two a byte, low
    nibble first. Gives ``(blocks [..., G, 16], scales [..., G])``."""
    blocks = w.float().unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(2.0**-126)
    exponent = torch.floor(torch.log2(amax)) - 2
    scaled = (blocks / torch.exp2(exponent)).clamp(-6, 6)
    index = (scaled.abs()[..., None] - E2M1).abs().argmin(-1)
    nibbles = (index | ((scaled < 0).long() << 3)).to(torch.uint8)
    packed = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return packed, (exponent[..., 0] + 127).to(torch.uint8)


def quantize_fp8(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 (DeepSeek-V3): per block, scale = amax / 448 (E4M3's largest), weight / scale
    in float8_e4m3fn; ``weight_scale_inv`` is the scale."""
    rows, cols = w.shape
    tiles = w.float().reshape(rows // block[0], block[0], cols // block[1], block[1])
    scale = tiles.abs().amax(dim=(1, 3), keepdim=True) / 448.0
    q = (tiles / scale).to(torch.float8_e4m3fn).reshape(rows, cols)
    return q, scale[:, 0, :, 0].contiguous()


def requantize(folder, quantize_tensor, quantization_config):
    """Rewrite ``folder``'s checkpoint with the tensors ``quantize_tensor`` picks quantized."""
    path = folder / "model.safetensors"
    tensors = {}
    for name, t in load_file(path).items():
        tensors.update(quantize_tensor(name, t) or {name: t})
    save_file(tensors, str(path), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(cfg))


def assert_loads_as_transformers(folder):
    """Our dequantized tensors equal the weights of transformers' dequantized model, bit for
    bit, and the engine generates its greedy tokens."""
    from transformers import AutoModelForCausalLM

    source = ModelSource(str(folder), str(folder))
    ours = dict(dequantized(iter_weights(source), load_config(source)))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    for name, tensor in ours.items():
        assert torch.equal(tensor, hf[name]), name
    got = [o.outputs[0].token_ids for o in tiny_llm(folder).generate(PROMPTS, GREEDY)]
    assert got == hf_greedy(folder, PROMPTS, GREEDY.max_tokens)


def test_mxfp4_dequantizer_is_transformers(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    w = torch.randn(3, 40, 64) * torch.logspace(-3, 2, 40)[None, :, None]
    blocks, scales = quantize_mxfp4(w)
    ours = dequantize_mxfp4(blocks, scales)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    # [..., rows, G*32] back to the input's layout: within E2M1's half step of each block
    back = ours.transpose(-1, -2)
    amax = w.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True)
    err = (back - w).unflatten(-1, (-1, 32)).abs() / amax
    assert err.max() <= 0.25


def test_mxfp4_gpt_oss_checkpoint_matches_transformers(tmp_path):
    folder = make_tiny_model(
        tmp_path / "gpt-oss",
        "gpt_oss",
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=64,
        head_dim=16,
        sliding_window=8,
    )

    def experts(name, t):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(t.transpose(-1, -2))
            return {f"{name}_blocks": blocks, f"{name}_scales": scales}
        return None

    requantize(
        folder,
        experts,
        {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
    )
    assert_loads_as_transformers(folder)


def test_block_fp8_checkpoint_matches_transformers(tmp_path):
    folder = make_tiny_model(tmp_path / "qwen3-fp8", "qwen3")
    block = [16, 32]

    def linears(name, t):
        if ".layers." in name and name.endswith("proj.weight"):
            q, scale = quantize_fp8(t, block)
            return {name: q, f"{name}_scale_inv": scale}
        return None

    requantize(
        folder,
        linears,
        {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": block,
        },
    )
    assert_loads_as_transformers(folder)


def test_a_quantized_weight_without_its_scale_is_refused(tmp_path):
    folder = make_tiny_model(tmp_path / "m", "qwen3")
    dropped = "model.layers.1.mlp.down_proj.weight"

    def linears(name, t):
        if ".layers." in name and name.endswith("proj.weight"):
            q, scale = quantize_fp8(t, [16, 32])
            return {name: q} if name == dropped else {name: q, f"{name}_scale_inv": scale}
        return None

    requantize(folder, linears, {"quant_method": "fp8", "weight_block_size": [16, 32]})
    with pytest.raises(ValueError, match=dropped.replace(".", r"\.")):
        tiny_llm(folder)


def test_unknown_quantization_is_refused(tmp_path):
    folder = make_tiny_model(tmp_path / "m", "llama")
    requantize(folder, lambda name, t: None, {"quant_method": "squeezellm"})
    with pytest.raises(ValueError, match="quant_method='squeezellm' is not supported"):
        tiny_llm(folder)
