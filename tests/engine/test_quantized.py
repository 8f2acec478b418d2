"""Quantized checkpoints as AutoAWQ, GPTQModel and llm-compressor write them
(``tests/quantized_checkpoints.py``) load as stored and give Hugging Face's greedy tokens on the
same weights dequantized into a plain checkpoint (fp32): every GPTQ option (4 and 8 bits,
symmetric or not, v1 and v2 zero points, act order, channel-wise), AWQ, compressed-tensors
W4A16 (group and channel, with and without zero points), W8A8 INT8 and FP8 (weights packed,
activations in the model dtype), on a llama and on MoE families. The projections stay packed
(about a quarter of their bf16 bytes at 4 bits, measured), configs pagedq cannot run are refused
naming the field, and two tensor-parallel ranks give the same tokens."""

from __future__ import annotations

import json

import pytest
import torch
from quantized_checkpoints import write_awq, write_compressed_tensors, write_gptq
from tiny_models import default_tokenizer, tiny_hf_model

from engine import LLM
from engine.models.moe import FusedMoE
from engine.quantization.linear import QuantizedLinear
from tests.engine.test_architectures import (
    GREEDY,
    PROMPTS,
    hf_greedy,
    one_thread,  # noqa: F401
    tiny_llm,
)

pytestmark = pytest.mark.slow

LLAMA = dict(hidden_size=64, intermediate_size=128)
QWEN3_MOE = dict(
    hidden_size=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
    head_dim=16, decoder_sparse_step=1,
)  # fmt: skip
CASES = {
    "gptq-sym": ("llama", write_gptq, dict(bits=4, sym=True)),
    "gptq-asym-act-order": ("llama", write_gptq, dict(bits=4, sym=False, desc_act=True)),
    "gptq-v2": ("llama", write_gptq, dict(bits=4, sym=False, checkpoint_format="gptq_v2")),
    "gptq-8bit-channel": (
        "llama", write_gptq,
        dict(bits=8, group_size=-1, sym=False, desc_act=True, checkpoint_format="gptq_v2"),
    ),
    "awq": ("llama", write_awq, {}),
    "w4a16": ("llama", write_compressed_tensors, dict(scheme="w4a16")),
    "w4a16-channel-zero-point": (
        "llama", write_compressed_tensors,
        dict(scheme="w4a16", strategy="channel", symmetric=False),
    ),
    "w8a8-int8": ("llama", write_compressed_tensors, dict(scheme="w8a8-int8")),
    "w8a8-fp8-static": ("llama", write_compressed_tensors, dict(scheme="w8a8-fp8", dynamic=False)),
    "qwen3-moe-awq": ("qwen3_moe", write_awq, {}),
    "qwen3-moe-w4a16-zero-point": (
        "qwen3_moe", write_compressed_tensors, dict(scheme="w4a16", symmetric=False),
    ),
}  # fmt: skip
_BUILT: dict[str, tuple] = {}


def built(case_id, tmp_path_factory):
    """``(quantized folder, HF greedy tokens of PROMPTS on its dequantized weights)``."""
    if case_id not in _BUILT:
        model_type, write, options = CASES[case_id]
        overrides = LLAMA if model_type == "llama" else QWEN3_MOE
        model = tiny_hf_model(model_type, vocab_size=len(default_tokenizer()), **overrides)
        root = tmp_path_factory.mktemp(case_id)
        quant, ref = write(model, root / "quant", root / "ref", **options)
        _BUILT[case_id] = quant, hf_greedy(str(ref), PROMPTS, GREEDY.max_tokens)
    return _BUILT[case_id]


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("case_id", list(CASES))
def test_quantized_checkpoint_gives_hf_greedy_tokens_of_its_dequantized_weights(
    case_id, tmp_path_factory
):
    folder, expected = built(case_id, tmp_path_factory)
    llm = tiny_llm(folder)
    model = llm.llm_engine.model
    packed = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    # Every attention projection and MLP of the llama, every projection and expert of the MoE,
    # stay packed.
    assert len(packed) == (4 if CASES[case_id][0] == "llama" else 2) * 2
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert all(m.quant is not None and m.w13_weight is None for m in moes)
    assert len(moes) == (0 if CASES[case_id][0] == "llama" else 2)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


def test_four_bit_projections_take_about_a_quarter_of_their_bf16_bytes(tmp_path):
    model = tiny_hf_model(
        "llama", vocab_size=len(default_tokenizer()), hidden_size=128, intermediate_size=256
    )
    quant, ref = write_gptq(model, tmp_path / "quant", tmp_path / "ref", group_size=128)
    packed_model = LLM(str(quant), dtype="bfloat16", kv_cache_memory=2**22).llm_engine.model
    plain_model = LLM(str(ref), dtype="bfloat16", kv_cache_memory=2**22).llm_engine.model
    layers = [m for m in packed_model.layers.modules() if isinstance(m, QuantizedLinear)]
    packed = sum(
        t.numel() * t.element_size() for m in layers for t in (m.qweight, m.scales, m.zeros)
    )
    weights = sum(m.in_features * m.out_features for m in layers)
    # 4 bits a weight, and an fp32 scale and zero per group of 128: 0.5625 bytes, bf16's 2.
    assert packed == weights // 2 + weights // 128 * 8
    assert packed / (2 * weights) < 0.29
    # The whole model (a 49152-row embedding and LM head stay bf16) shrinks by what they saved.
    saved = plain_model.weight_bytes() - packed_model.weight_bytes()
    assert saved >= 2 * weights - packed - 4096


def _refusal(tmp_path, edit) -> str:
    model = tiny_hf_model("llama", vocab_size=len(default_tokenizer()), **LLAMA)
    quant, _ = write_gptq(model, tmp_path / "quant", tmp_path / "ref")
    config_path = quant / "config.json"
    config = json.loads(config_path.read_text())
    edit(config["quantization_config"])
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError) as excinfo:
        tiny_llm(quant)
    return str(excinfo.value)


@pytest.mark.parametrize(
    "method, field, value, message",
    [
        ("gptq", "bits", 3, "quantization_config.bits=3 is not supported: must be one of (4, 8)"),
        ("gptq", "checkpoint_format", "marlin", "quantization_config.checkpoint_format='marlin'"),
        ("awq", "version", "gemv", "quantization_config.version='gemv' is not supported"),
        ("compressed-tensors", "format", "nvfp4-pack-quantized",
         "quantization_config.format='nvfp4-pack-quantized' is not supported: must be one of"),
        ("squeezellm", None, None, "quant_method='squeezellm' is not supported"),
    ],
)  # fmt: skip
def test_a_config_pagedq_cannot_run_is_refused_naming_the_field(
    tmp_path, method, field, value, message
):
    def edit(qc):
        qc["quant_method"] = method
        if method == "awq":
            qc.update(bits=4, zero_point=True)
        if method == "compressed-tensors":
            qc["config_groups"] = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4}}}
        if field is not None:
            qc[field] = value

    assert message in _refusal(tmp_path, edit)


def test_an_unknown_weight_strategy_is_refused_naming_the_group(tmp_path):
    def edit(qc):
        qc.clear()
        qc.update(
            quant_method="compressed-tensors",
            format="pack-quantized",
            config_groups={"group_0": {"weights": {"num_bits": 4, "strategy": "attn_head"}}},
        )

    assert "config_groups.group_0.weights.strategy='attn_head' is not supported" in _refusal(
        tmp_path, edit
    )


@pytest.mark.parametrize("case_id", ["gptq-v2", "qwen3-moe-awq"])
def test_two_ranks_give_the_same_tokens(case_id, tmp_path_factory):
    # Last in the module: a process has one tensor-parallel group at a time.
    folder, expected = built(case_id, tmp_path_factory)
    with LLM(str(folder), dtype="float32", tensor_parallel_size=2, kv_cache_memory=2**22) as llm:
        model = llm.llm_engine.model
        if case_id == "gptq-v2":  # half the down projection's input, two values a byte
            assert model.layers[0].mlp.down_proj.qweight.shape == (64, 32)
        else:  # half the experts, packed
            assert model.layers[0].mlp.w13_qweight.shape == (2, 128, 32)
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    torch.set_num_threads(1)
