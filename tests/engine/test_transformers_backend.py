"""The Transformers modeling backend: each model type it claims (``TRANSFORMERS_BACKEND_TYPES``,
what ``pagedq models`` lists) gives Hugging Face's greedy tokens (fp32) from a tiny random
checkpoint, with sliding windows shorter than the prompts and several experts per token; native
families run through it give the native tokens; chunked prefill, preemption, a JSON schema,
quantized checkpoints and the Triton kernels hold on it; what it cannot run is refused at load,
naming the layer class or config field."""

from __future__ import annotations

import pytest
import torch
from quantized_checkpoints import write_awq, write_gptq
from tiny_models import default_tokenizer, make_tiny_model, tiny_hf_model

from engine import LLM, SamplingParams
from engine.models import model_impls
from engine.models.transformers import TRANSFORMERS_BACKEND_TYPES
from engine.quantization.linear import QuantizedLinear
from tests.engine.test_architectures import (
    GREEDY,
    MAX_TOKENS,
    PROMPTS,
    built,
    case_builder,  # noqa: F401
    check_json_schema,
    hf_greedy,
    mismatch_checkpoint,
    tiny_llm,
    token_ids,
)

pytestmark = pytest.mark.slow

WINDOW = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}

# (id, model_type, config overrides): one row per claimed type at least. Windows of 8 tokens
# (the prompts run to 33), MoE routing 3 experts of 6-8 per token.
CASES = [
    (
        "afmoe",  # windows, gated attention, QK-norm, sigmoid routing with a bias, shared expert
        "afmoe",
        {"head_dim": 16, **WINDOW, "num_experts": 8, "num_experts_per_tok": 3,
         "moe_intermediate_size": 32},
    ),
    ("apertus", "apertus", {}),  # xIELU activation, QK-norm
    ("apertus1p5_text", "apertus1p5_text", {}),
    ("aria_text", "aria_text", {"head_dim": 16, "moe_num_experts": 8, "moe_topk": 3}),
    ("ctrl", "ctrl", {}),  # sinusoidal positions, fused-in-one-module attention
    ("flex_olmo", "flex_olmo", {"num_experts": 8, "num_experts_per_tok": 3, "pad_token_id": 0}),
    ("flint", "flint", {"head_dim": 16, **WINDOW, "num_experts": 8, "num_experts_per_tok": 3,
                        "moe_intermediate_size": 32}),
    ("gpt-sw3", "gpt-sw3", {}),  # GPT-2's classes under its own model_type
    ("granite_swa", "granite_swa", WINDOW),
    ("granitemoe_swa", "granitemoe_swa", {**WINDOW, "num_local_experts": 8,
                                          "num_experts_per_tok": 3}),
    ("hy_v3", "hy_v3", {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 3,
                        "moe_intermediate_size": 32}),
    ("hyperclovax", "hyperclovax", {"head_dim": 16}),
    ("iquestcoder", "iquestcoder", {"head_dim": 16}),  # Llama's classes under its own type
    ("jais2", "jais2", {"head_dim": 16}),
    ("kolibri1", "kolibri1", {"head_dim": 16, **WINDOW, "num_local_experts": 8,
                              "num_experts_per_tok": 3, "moe_intermediate_size": 32}),
    ("laguna", "laguna", {"head_dim": 16, "sliding_window": 8, "num_experts": 8,
                          "num_experts_per_tok": 3, "moe_intermediate_size": 32}),
    ("minimax_m3_vl_text", "minimax_m3_vl_text", {"head_dim": 16, "rotary_dim": 8,
                                                  "num_local_experts": 8,
                                                  "num_experts_per_tok": 3}),
    ("sarvam_moe", "sarvam_moe",  # GLM-4.5's classes: grouped sigmoid routing, a dense layer 0
     {"head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 3,
      "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
    ("arcee", "arcee", {}),  # ReLU^2 MLP
    ("beam", "beam",  # windows, experts, final soft-capping written with a cast to fp32
     {"head_dim": 16, **WINDOW, "num_experts": 8, "num_experts_per_tok": 3,
      "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1}),
    ("bitnet", "bitnet", {}),  # sub-norms inside attention and MLP, ReLU^2 (weights unpacked)
    ("cohere", "cohere", {}),  # parallel block, LayerNorm, logit_scale
    ("cohere2", "cohere2", WINDOW),  # windows, no RoPE on the full layers
    # North (Cohere Compass' text model): a RoPE base per layer type, windows
    ("cohere_compass_text", "cohere_compass_text", {**WINDOW, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 50000.0}}}),
    ("cohere2_moe", "cohere2_moe",  # parallel block and windows of cohere2, with experts
     {"head_dim": 16, **WINDOW, "num_experts": 8, "num_experts_per_tok": 3}),
    ("cwm", "cwm", {"head_dim": 16, **WINDOW}),  # Llama with sliding/full layers, llama3 RoPE
    (
        "dbrx",  # fused Wqkv clipped at clip_qkv, nested attn/ffn configs, its own expert layout
        "dbrx",
        {"d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 512,
         "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
         "ffn_config": {"moe_num_experts": 8, "moe_top_k": 3, "ffn_hidden_size": 32}},
    ),
    (
        "dots1",  # QK-norm, layer 0 dense, grouped top-k over experts beside a shared expert
        "dots1",
        {"n_routed_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
         "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
    ),
    ("ernie4_5", "ernie4_5", {}),
    (
        "ernie4_5_moe",
        "ernie4_5_moe",
        {"moe_num_experts": 8, "moe_k": 3, "moe_intermediate_size": 32,
         "moe_num_shared_experts": 1, "tie_word_embeddings": False},
    ),
    ("exaone", "exaone", {"head_dim": 16}),  # EXAONE 3's checkpoint names on Llama's classes
    ("exaone4", "exaone4", WINDOW),  # post-norms, QK-norm, windows
    (
        "exaone_moe",  # windows, layer 0 dense, routing with a correction bias, shared expert
        "exaone_moe",
        {**WINDOW, "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
         "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
    ),
    ("gemma", "gemma", {"head_dim": 16}),  # (1 + w) RMSNorm, embeddings scaled by sqrt(hidden)
    ("glm", "glm", {"pad_token_id": 0}),  # partial interleaved RoPE
    ("glm4", "glm4", {"pad_token_id": 0}),
    ("codegen", "codegen", {"rotary_dim": 8}),  # fused qkv in model-parallel blocks, partial RoPE
    ("gpt2", "gpt2", {}),  # learned positions, Conv1D projections (weights transposed)
    ("gpt_bigcode", "gpt_bigcode", {}),  # StarCoder 1: multi-query attention, learned positions
    ("gpt_neox", "gpt_neox", {}),  # base model `gpt_neox`, LM head `embed_out` on disk
    ("gptj", "gptj", {"rotary_dim": 8}),  # parallel block, interleaved partial RoPE
    (
        "granite",  # every multiplier of its own: softmax scale, embeddings, residual, logits
        "granite",
        {"attention_multiplier": 0.2, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
         "logits_scaling": 4.0},
    ),
    ("granitemoe", "granitemoe",
     {"num_local_experts": 6, "num_experts_per_tok": 3, "logits_scaling": 2.0}),
    ("granitemoeshared", "granitemoeshared",  # Granite's multipliers, experts and a shared MLP
     {"num_local_experts": 8, "num_experts_per_tok": 3}),
    ("helium", "helium", {"head_dim": 16}),
    ("hunyuan_v1_dense", "hunyuan_v1_dense", {"head_dim": 16}),
    ("hunyuan_v1_moe", "hunyuan_v1_moe",  # QK-norm after RoPE, experts beside a shared MLP
     {"head_dim": 16, "num_experts": 8, "moe_topk": 3}),
    ("internlm3", "internlm3", {"head_dim": 16}),  # Llama's classes under its own model_type
    ("jetmoe", "jetmoe",  # mixture of attention heads (routed q/o experts) and of MLP experts
     {"num_local_experts": 8, "num_experts_per_tok": 3}),
    ("mellum", "mellum",  # experts with a top-k router
     {"head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 3,
      "moe_intermediate_size": 32}),
    ("minimax_m2", "minimax_m2",  # QK-norm over all heads, sigmoid routing with a correction bias
     {"head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 3}),
    ("ministral", "ministral", {"head_dim": 16, **WINDOW}),
    ("ministral3", "ministral3", {}),  # YaRN RoPE
    ("nanochat", "nanochat", {}),  # ReLU^2, norms without weights, final soft-capping
    ("nemotron", "nemotron", {}),  # partial RoPE, LayerNorm1P
    ("olmo", "olmo", {}),  # LayerNorm without parameters
    ("opt", "opt", {}),  # learned positions offset by 2, layers one level down (decoder.layers)
    ("olmoe", "olmoe", {"num_experts": 8, "num_experts_per_tok": 3}),
    ("bert-generation", "bert-generation", {"is_decoder": True}),  # post-LN BERT, causal
    ("olmoe-fused", "olmoe",  # transformers 5's own layout: fused 3-D experts on disk
     {"num_experts": 8, "num_experts_per_tok": 3, "save_original_format": False}),
    ("persimmon", "persimmon", {}),  # fused QKV, QK LayerNorm, partial RoPE, ReLU^2
    ("phi", "phi", {}),  # parallel block, LayerNorm, partial RoPE, biased LM head
    ("phimoe", "phimoe",  # sparsemixer routing, LayerNorm, a window on every layer
     {"sliding_window": 8, "num_local_experts": 8, "num_experts_per_tok": 3}),
    ("seed_oss", "seed_oss", {}),
    (
        "smollm3",  # every other layer without RoPE, and windowed
        "smollm3",
        {"pad_token_id": 0, "no_rope_layers": [1, 0], "use_sliding_window": True,
         "sliding_window": 8},
    ),
    ("solar_open", "solar_open",  # grouped sigmoid routing with a correction bias, shared expert
     {"head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 3,
      "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1}),
    ("stablelm", "stablelm", {"use_qkv_bias": True}),  # partial RoPE, LayerNorm, QKV bias
    ("starcoder2", "starcoder2", {"sliding_window": 8}),  # window on every layer
    (
        "vaultgemma",  # attention soft-capping and final soft-capping, windows
        "vaultgemma",
        {"head_dim": 16, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0, **WINDOW},
    ),
]  # fmt: skip
CASE_BY_ID = {case_id: (model_type, overrides) for case_id, model_type, overrides in CASES}
# Native families through the backend: their cases of test_architectures.py, and qwen2.
NATIVE_CASES = ["llama", "qwen3-moe", "qwen2-bias"]
backend_case = case_builder(CASE_BY_ID)


def test_every_claimed_type_has_a_case():
    claimed = {model_type for _, model_type, _ in CASES}
    assert set(TRANSFORMERS_BACKEND_TYPES) == claimed
    assert {t: model_impls()[t] for t in claimed} == dict.fromkeys(claimed, "transformers")


def test_pagedq_models_lists_each_type_and_the_path_that_serves_it(capsys):
    import pagedq_cli

    assert pagedq_cli.main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["model_type", "path"]
    rows = dict(line.split() for line in lines[1:] if len(line.split()) == 2)
    assert rows == model_impls()
    assert rows["llama"] == "native" and rows["cohere2"] == "transformers"


@pytest.mark.parametrize("case_id", list(CASE_BY_ID))
def test_backend_matches_hf(tmp_path_factory, case_id):
    folder, expected = backend_case(case_id, tmp_path_factory)
    llm = tiny_llm(folder)  # model_impl="auto": no native family, the backend
    assert type(llm.llm_engine.model).__name__ == "TransformersForCausalLM"
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


@pytest.mark.parametrize("case_id", ["cohere", "granite", "vaultgemma", "beam"])
def test_scaled_and_capped_logits_match_hf(tmp_path_factory, case_id):
    """``logit_scale``, ``logits_scaling`` and final soft-capping keep the argmax: the first
    token's logprobs show them."""
    from transformers import AutoModelForCausalLM

    folder, _ = backend_case(case_id, tmp_path_factory)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = hf(torch.tensor(PROMPTS[:1])).logits[0, -1].log_softmax(-1)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    got = tiny_llm(folder).generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert len(got.logprobs[0]) >= 5
    for token, logprob in got.logprobs[0].items():
        assert logprob == pytest.approx(want[token].item(), abs=1e-4)


def test_the_triton_kernels_run_the_backend(tmp_path_factory):
    """``attention_backend="triton"`` (interpreted on the CPU here, compiled on CUDA): paged
    attention and the fused experts run on pagedq's Triton kernels and give HF's tokens."""
    folder, expected = backend_case("olmoe", tmp_path_factory)
    llm = tiny_llm(folder, attention_backend="triton")
    model = llm.llm_engine.model
    experts = [m for m in model.modules() if getattr(m, "pagedq_backend", None) == "triton"]
    assert len(experts) == 2 and all(getattr(m, "packed", None) is None for m in experts)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert token_ids(llm.generate(PROMPTS[:1], params, use_tqdm=False)) == [expected[0][:3]]


@pytest.mark.parametrize("case_id", NATIVE_CASES)
def test_native_family_through_the_backend_gives_the_native_tokens(tmp_path_factory, case_id):
    folder, expected = built(case_id, tmp_path_factory)
    native = token_ids(tiny_llm(folder).generate(PROMPTS, GREEDY, use_tqdm=False))
    backend = tiny_llm(folder, model_impl="transformers")
    assert type(backend.llm_engine.model).__name__ == "TransformersForCausalLM"
    assert token_ids(backend.generate(PROMPTS, GREEDY, use_tqdm=False)) == native == expected


def test_windows_free_blocks_and_regimes_match_hf(tmp_path_factory):
    """On a windowed backend family: sliding layers get their own KV group, and chunked
    prefill, preemption (recompute and swap) and a JSON schema hold."""
    folder, expected = backend_case("cohere2", tmp_path_factory)
    chunked = tiny_llm(folder, max_num_batched_tokens=8)
    assert [kind for kind, _ in chunked.stats.kv_blocks_by_group] == [
        "sliding_window=8",
        "full_attention",
    ]
    assert token_ids(chunked.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    assert chunked.stats.num_chunked_prefills > 0

    engine = tiny_llm(folder).llm_engine
    longest = max(len(p) for p in PROMPTS) + MAX_TOKENS
    num_blocks = engine.kv_cache_manager.num_blocks_for(longest) + 1
    for swap_space, kind in ((0, "recompute"), (0.01, "swap")):
        small = tiny_llm(
            folder, kv_cache_memory=num_blocks * engine._kv_bytes_per_block(), swap_space=swap_space
        )
        assert token_ids(small.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
        assert getattr(small.stats, f"num_preemptions_{kind}") > 0, kind

    check_json_schema(chunked)


@pytest.mark.parametrize(
    "model_type,write,options,overrides",
    [
        ("olmo", write_gptq, dict(bits=4, sym=False, desc_act=True), {}),
        ("olmoe", write_awq, {}, dict(num_experts=4, num_experts_per_tok=2)),
    ],
)
def test_quantized_checkpoints_of_backend_families(tmp_path, model_type, write, options, overrides):
    """GPTQ and AWQ checkpoints swap the backend's linears (the checkpoint's names are the
    model's) and give HF's greedy tokens on their dequantized weights; experts in transformers'
    fused layout load dequantized."""
    model = tiny_hf_model(model_type, vocab_size=len(default_tokenizer()), **overrides)
    quant, ref = write(model, tmp_path / "quant", tmp_path / "ref", **options)
    llm = tiny_llm(quant)
    modules = list(llm.llm_engine.model.modules())
    # q, k, v, o, gate, up, down in both layers (MoE: attention only)
    assert sum(isinstance(m, QuantizedLinear) for m in modules) == (8 if overrides else 14)
    expected = hf_greedy(str(ref), PROMPTS, MAX_TOKENS)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


@pytest.mark.parametrize(
    "model_type,overrides,match",
    [
        ("lfm2", {"layer_types": ["conv", "full_attention"]}, r"Lfm2ShortConv .*convolution"),
        ("mamba", {}, r"MambaBlock .*recurrent"),
        ("minimax", {"layer_types": ["linear_attention", "full_attention"]},
         r"config\.layer_types has \['linear_attention'\]"),
        ("diffllama", {}, r"attention layer indices \[0, 0, 1, 1\]"),  # two softmaxes a layer
        ("doge", {}, r"DogeAttention builds an attention mask of its own"),
        ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2, "alibi": False},
         r"FalconForCausalLM does not call transformers' AttentionInterface"),
        ("deepseek_v2", {"kv_lora_rank": 32, "q_lora_rank": 32, "qk_nope_head_dim": 16,
                         "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4,
                         "num_experts_per_tok": 2},
         r"values .* differ in heads or head size"),
        ("bert-generation", {"is_decoder": False}, r"config\.is_decoder=False"),
    ],
)  # fmt: skip
def test_what_the_backend_cannot_run_is_refused_at_load(tmp_path, model_type, overrides, match):
    folder = make_tiny_model(tmp_path / "m", model_type, **overrides)
    with pytest.raises(ValueError, match=match):
        tiny_llm(folder, model_impl="transformers")  # lfm2 is native under "auto"


@pytest.mark.parametrize(
    "change,match",
    [
        ("shape", r"weight 'model\.layers\.1\.mlp\.down_proj\.weight': shape \(64, 64\)"),
        ("unknown", r"unexpected weight 'model\.layers\.1\.mlp\.extra_proj\.weight'"),
        ("missing", r"missing weights: \['model\.layers\.1\.mlp\.down_proj\.weight'\]"),
    ],
)
def test_a_checkpoint_that_does_not_match_its_config_is_refused(tmp_path, change, match):
    folder = make_tiny_model(tmp_path / "m", "olmo")
    mismatch_checkpoint(folder, change)
    with pytest.raises(ValueError, match=match):
        tiny_llm(folder)


def test_an_encoder_decoder_is_refused(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("t5", vocab_size=len(default_tokenizer())).save_pretrained(tmp_path)
    default_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model_type='t5': config\.is_encoder_decoder=True"):
        tiny_llm(tmp_path)


def test_native_only_refuses_a_backend_family(tmp_path_factory):
    folder, _ = backend_case("olmo", tmp_path_factory)
    with pytest.raises(ValueError, match=r"model_type='olmo' has no native implementation"):
        tiny_llm(folder, model_impl="native")


def test_a_length_dependent_rope_is_refused(tmp_path_factory):
    folder, _ = built("rope-dynamic", tmp_path_factory)
    with pytest.raises(ValueError, match=r"rope_type='dynamic'"):
        tiny_llm(folder, model_impl="transformers")


def test_tensor_parallel_refuses_heads_it_cannot_split_naming_both_settings(tmp_path):
    """The backend splits by the config's tensor-parallel plan
    (tests/engine/test_transformers_backend_parallel.py); a head count the ranks do not divide
    (one KV head over two ranks) is refused before any rank starts."""
    folder = make_tiny_model(tmp_path, "olmo", num_key_value_heads=1)
    match = r"model_impl='auto' serves model_type='olmo' on the Transformers backend, which "
    match += r"cannot split it over tensor_parallel_size=2: config\.num_key_value_heads=1 is "
    match += r"not divisible by tensor_parallel_size=2"
    with pytest.raises(ValueError, match=match):  # before any rank starts: none to stop
        LLM(str(folder), dtype="float32", kv_cache_memory=2**22, tensor_parallel_size=2)
