"""Each supported architecture, as a tiny random checkpoint made at test time from transformers'
own config class, gives Hugging Face's greedy tokens.

A family adds its rows to ``CASES``: (id, model_type, config overrides). Prompts are longer than
the sliding windows a case sets, and MoE cases route several experts per token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import causal_lm_class, make_tiny_model

from engine import LLM, SamplingParams
from engine.structured_outputs import StructuredOutputsParams

MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [[1, 504, 3458, 282, 4649, 314], [5, 77, 901, 12, 12, 3000, 45, 8, 9, 10, 11] * 3, [42]]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One thread for both engines: on a shared 2-core host, two threads spend most of these
    tiny models' time waiting for each other (10x slower measured under load)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def hf_greedy(folder, prompts, n):
    """Hugging Face ``generate``'s greedy tokens for each prompt (fp32, no EOS stop)."""
    model_type = json.loads((Path(folder) / "config.json").read_text())["model_type"]
    model = causal_lm_class(model_type).from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            )
            outs.append(out[0, len(prompt) :].tolist())
    return outs


def tiny_llm(folder, **kwargs) -> LLM:
    """An fp32 engine on ``folder`` with a small KV pool, on one thread."""
    return LLM(
        str(folder),
        dtype="float32",
        kv_cache_memory=kwargs.pop("kv_cache_memory", 2**22),
        block_size=16,
        num_threads=1,
        **kwargs,
    )


SLIDING_FULL = ["sliding_attention", "full_attention"]
# Gemma's own head size and softmax scale (query_pre_attn_scalar is not head_dim here).
GEMMA = {"head_dim": 16, "query_pre_attn_scalar": 24, "layer_types": SLIDING_FULL}

QWEN3_5 = {
    "head_dim": 16, "num_hidden_layers": 3,
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}  # fmt: skip

OLMO_HYBRID = {
    "num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention",
    "linear_attention"], "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "pad_token_id": 0,
}  # fmt: skip

LFM2 = {
    "num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "conv"],
    "conv_L_cache": 3, "block_multiple_of": 32, "norm_eps": 1e-6,
}  # fmt: skip

# Mamba-2 layers around one attention layer: 8 heads of 16 in 2 groups, 8-wide states, HF's
# chunks shorter than the longest prompt.
GRANITE_H = {
    "num_hidden_layers": 3, "layer_types": ["mamba", "attention", "mamba"], "mamba_n_heads": 8,
    "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 8, "mamba_chunk_size": 16,
    "shared_intermediate_size": 48,
}  # fmt: skip

FALCON_H1 = {
    "num_hidden_layers": 2, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_ssm": 128,
    "mamba_n_groups": 2, "mamba_d_state": 8, "mamba_chunk_size": 16,
}  # fmt: skip

# Three layers, the first dense; experts in 4 groups of 2, 3 experts per token from the best 2.
DEEPSEEK = {
    "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_key_value_heads": 4,
    "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 24,
    "n_routed_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
    "n_group": 4, "topk_group": 2, "n_shared_experts": 1, "routed_scaling_factor": 2.0,
}  # fmt: skip

# DeepSeek-V3's block as other families configure it: latent attention with the q LoRA and
# experts (8, 3 per token) beside a shared one.
MLA = {
    "num_hidden_layers": 3, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16, "v_head_dim": 24, "q_lora_rank": 24,
}  # fmt: skip
MLA_MOE = {
    **MLA, "n_routed_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
    "n_shared_experts": 1, "routed_scaling_factor": 2.0,
}  # fmt: skip

DSA = {**MLA_MOE, "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, "index_topk": 8,
       "index_head_dim": 32, "index_n_heads": 4}  # fmt: skip

# KDA layers first and last around a NoPE latent-attention one (q_proj, as Kimi ships it); the
# first MLP dense, then DeepSeek's experts under Kimi's names. HF's pad id (163839) is past
# this vocabulary.
KDA = "linear_attention"
KIMI_LINEAR = {
    "num_hidden_layers": 3, "layer_types": [KDA, "full_attention", KDA], "linear_num_heads": 4,
    "linear_head_dim": 16, "num_key_value_heads": 4, "kv_lora_rank": 32,
    "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 24, "num_experts": 8,
    "num_experts_per_tok": 3, "moe_intermediate_size": 32, "n_group": 4, "topk_group": 2,
    "n_shared_experts": 1, "routed_scaling_factor": 2.0, "pad_token_id": 0,
}  # fmt: skip

# Ling 3: KDA layers around a rotated latent-attention one gated per head; full-rank KDA gates
# over q/k/v convs; a dense first MLP, then grouped sigmoid experts. The second case takes the
# query LoRA and Kimi's unbounded decay, saved in transformers 5's layout (one conv, 3-D experts).
LING = {
    "num_hidden_layers": 3, "layer_types": [KDA, "full_attention", KDA], "head_dim": 16,
    "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
    "v_head_dim": 24, "num_local_experts": 8, "num_experts_per_tok": 3,
    "moe_intermediate_size": 32, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.0, "pad_token_id": 0,
}  # fmt: skip

CASES = [
    ("llama", "llama", {}),
    (
        "llama3-rope",
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    ("qwen2-bias", "qwen2", {}),
    ("qwen3-qknorm", "qwen3", {}),
    ("mistral-tied", "mistral", {"tie_word_embeddings": True}),
    ("rope-linear", "llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    (
        "rope-dynamic",  # past max_position_embeddings (24) the base grows with the length
        "llama",
        {"max_position_embeddings": 24, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
    ),
    (
        "rope-yarn",  # attention factor 0.1 ln(4) + 1 on cos/sin
        "llama",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    ("gemma2", "gemma2", {**GEMMA, "sliding_window": 8}),
    (
        "gemma3-text",  # local base 10k, global 1M with linear scaling, as Gemma 3 ships
        "gemma3_text",
        {
            **GEMMA,
            "sliding_window": 8,
            "final_logit_softcapping": 30.0,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
        },
    ),
    (
        "phi3-longrope",  # the 33-token prompt is past 30: long factors; the others short
        "phi3",
        {
            "original_max_position_embeddings": 30,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.1, 1.3, 1.6],
                "long_factor": [3.0, 9.0, 27.0, 81.0],
                "original_max_position_embeddings": 30,
            },
        },
    ),
    (
        "gemma4-text",  # 4 layers: sliding 16-dim heads, full 32-dim heads with K = V and a
        # proportional RoPE; the last two read the first two's caches; per-layer inputs
        "gemma4_text",
        {
            "num_hidden_layers": 4,
            "head_dim": 16,
            "global_head_dim": 32,
            "num_global_key_value_heads": 1,
            "layer_types": SLIDING_FULL * 2,
            "sliding_window": 8,
            "num_kv_shared_layers": 2,
            "attention_k_eq_v": True,
            "use_double_wide_mlp": True,
            "hidden_size_per_layer_input": 8,
            "final_logit_softcapping": 30.0,
        },
    ),
    (
        "gemma3n-text",  # AltUp streams, LAuReL, sparse GeGLU in the first layers, per-layer
        # inputs, the last two layers reading the first two's KV
        "gemma3n_text",
        {"num_hidden_layers": 4, "head_dim": 16, "layer_types": SLIDING_FULL * 2,
         "sliding_window": 8, "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 8,
         "laurel_rank": 8, "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0],
         "intermediate_size": [128, 96, 128, 64], "vocab_size_per_layer_input": 4000},
    ),
    (
        "gemma4-unified-text",  # Gemma 4 12B's text model: Gemma 4's layers, no per-layer inputs
        "gemma4_unified_text",
        {"num_hidden_layers": 4, "head_dim": 16, "global_head_dim": 32,
         "num_global_key_value_heads": 1, "layer_types": SLIDING_FULL * 2, "sliding_window": 8,
         "num_kv_shared_layers": 2, "attention_k_eq_v": True, "use_double_wide_mlp": True,
         "final_logit_softcapping": 30.0},
    ),
    (
        "gemma4-moe",  # 26B-A4B's block: routed GeGLU experts beside the dense MLP
        "gemma4_text",
        {
            "head_dim": 16,
            "global_head_dim": 32,
            "layer_types": SLIDING_FULL,
            "sliding_window": 8,
            "hidden_size_per_layer_input": 8,
            "enable_moe_block": True,
            "num_experts": 6,
            "top_k_experts": 2,
            "moe_intermediate_size": 32,
        },
    ),
    ("olmo2", "olmo2", {}),
    ("olmo3", "olmo3", {"sliding_window": 8, "layer_types": SLIDING_FULL}),
    # Mixtures of experts: several experts per token, per-expert and fused 3-D checkpoints.
    (
        "qwen3-moe",
        "qwen3_moe",
        {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 48,
         "head_dim": 16, "mlp_only_layers": [1], "norm_topk_prob": True},
    ),
    (
        "qwen3-moe-fused",
        "qwen3_moe",
        {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
         "head_dim": 16, "norm_topk_prob": False, "save_original_format": False},
    ),
    (
        "qwen2-moe-shared",
        "qwen2_moe",
        {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 48, "norm_topk_prob": False},
    ),
    (
        "mixtral-window",
        "mixtral",
        {"num_local_experts": 6, "num_experts_per_tok": 2, "intermediate_size": 96,
         "sliding_window": 8},
    ),
    (
        "gpt-oss",
        "gpt_oss",
        {"num_local_experts": 6, "num_experts_per_tok": 2, "intermediate_size": 64,
         "head_dim": 16, "sliding_window": 8, "num_hidden_layers": 3},
    ),
    (
        "glm4-moe",
        "glm4_moe",
        {"n_routed_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
         "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
         "partial_rotary_factor": 0.5, "head_dim": 16, "attention_bias": True,
         "routed_scaling_factor": 2.0, "num_hidden_layers": 3},
    ),
    # Hybrid linear attention: Gated DeltaNet layers first and last, a gated full-attention one.
    ("qwen3.5", "qwen3_5_text", QWEN3_5),
    (
        "qwen3.5-moe",
        "qwen3_5_moe_text",
        {**QWEN3_5, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 48},
    ),
    (
        "qwen3-next",  # in_proj_qkvz / in_proj_ba fused per key-head group; a dense layer
        "qwen3_next",
        {**QWEN3_5, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 48, "mlp_only_layers": [1]},
    ),
    # OLMo Hybrid: Gated DeltaNet in pre-norm blocks around an OLMo 3 post-norm one; in
    # transformers 5's layout (one conv tensor; its reverse conversion splits it evenly, so the
    # released layout is written only where q, k and v are of one size: the second case).
    ("olmo-hybrid", "olmo_hybrid", {**OLMO_HYBRID, "save_original_format": False}),
    ("olmo-hybrid-released", "olmo_hybrid", {**OLMO_HYBRID, "linear_num_value_heads": 2}),
    (
        "lara-mini",  # delta nets, a windowed RoPE layer, a NoPE full layer; experts everywhere
        "lara_mini",
        {**QWEN3_5, "num_hidden_layers": 4, "sliding_window": 8, "layer_types": [
         "linear_attention", "sliding_attention", "linear_attention", "full_attention"],
         "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 48},
    ),
    # Gated short convolutions around one attention layer; the MLP width adjusted (2/3, x96).
    ("lfm2", "lfm2", LFM2),
    (
        "lfm2-moe",  # a dense first layer, then sigmoid routing with an expert bias
        "lfm2_moe",
        {**LFM2, "num_dense_layers": 1, "num_experts": 6, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "routed_scaling_factor": 1.5},
    ),
    (
        "lfm3",  # windows beside full layers, a RoPE per type, head gates, sandwich norms
        "lfm3",
        {"num_hidden_layers": 4, "head_dim": 16, "sliding_window": 8, "conv_L_cache": 3,
         "layer_types": ["conv", "sliding_attention", "full_attention", "conv"],
         "norm_eps": 1e-6, "pad_token_id": 0},
    ),
    # Mamba-2 hybrids. Granite 4.0-H: no positions in attention, experts beside a shared MLP,
    # Granite's four multipliers; the dense variant with RoPE.
    (
        "granite-4.0-h",
        "granitemoehybrid",
        {**GRANITE_H, "num_local_experts": 6, "num_experts_per_tok": 2, "intermediate_size": 32,
         "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2,
         "logits_scaling": 1.5},
    ),
    (
        "granite-4.0-h-dense-rope",
        "granitemoehybrid",
        {**GRANITE_H, "num_local_experts": 0, "position_embedding_type": "rope"},
    ),
    (
        "bamba",  # Granite 4.0-H's parent: half-rotary attention at one index, SwiGLU MLPs
        "bamba",
        {"num_hidden_layers": 3, "attn_layer_indices": [1], "mamba_n_heads": 8,
         "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 8, "mamba_chunk_size": 16},
    ),
    (
        "nemotron-h",  # one mixer per block: Mamba-2, routed ReLU^2 experts, attention, MLP
        "nemotron_h",
        {"layers_block_type": ["mamba", "moe", "attention", "mlp", "mamba"], "mamba_num_heads": 8,
         "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 8, "chunk_size": 16,
         "head_dim": 16, "n_routed_experts": 6, "num_experts_per_tok": 2, "n_group": 2,
         "topk_group": 1, "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48,
         "intermediate_size": 48, "routed_scaling_factor": 1.5},
    ),
    (
        "falcon-h1",  # Mamba-2 beside attention in every layer, every µP multiplier set
        "falcon_h1",
        {**FALCON_H1, "embedding_multiplier": 2.0, "lm_head_multiplier": 0.5,
         "key_multiplier": 0.7, "attention_in_multiplier": 1.2, "attention_out_multiplier": 0.8,
         "ssm_in_multiplier": 1.3, "ssm_out_multiplier": 0.9, "mlp_multipliers": [1.1, 0.9],
         "ssm_multipliers": [1.1, 0.9, 1.2, 0.8, 1.05]},
    ),
    (
        "mamba2",  # no attention at all: Mamba-2 blocks only, the residual stream in fp32
        "mamba2",
        {"num_heads": 8, "head_dim": 16, "expand": 2, "n_groups": 2, "state_size": 8,
         "chunk_size": 16},
    ),
    # Mamba-1: a decay per state dimension, the time step low-rank; Falcon Mamba RMS-normalises
    # the time step, B and C; Jamba's Mamba-1 layers (weighted norms) beside attention without
    # positions, experts every third layer (on a Mamba and on an attention layer).
    ("mamba", "mamba", {"state_size": 8, "expand": 2, "time_step_rank": 6}),
    ("falcon-mamba", "falcon_mamba", {"state_size": 8, "expand": 2, "mixer_rms_eps": 1e-5}),
    (
        "jamba",
        "jamba",
        {"num_hidden_layers": 5, "attn_layer_period": 2, "attn_layer_offset": 1,
         "expert_layer_period": 3, "expert_layer_offset": 1, "num_experts": 6,
         "num_experts_per_tok": 2, "mamba_d_state": 8, "mamba_dt_rank": 6},
    ),
    (
        "zamba2",  # two shared blocks taking turns over three hybrid layers, adapters per use
        "zamba2",
        {"tie_word_embeddings": True, "num_hidden_layers": 5,
         "layers_block_type": ["mamba", "hybrid", "hybrid", "mamba", "hybrid"],
         "num_key_value_heads": 4, "num_mem_blocks": 2,
         "use_shared_attention_adapter": True, "adapter_rank": 8, "use_mem_rope": True,
         "n_mamba_heads": 8, "mamba_ngroups": 2, "mamba_d_state": 8, "chunk_size": 16},
    ),
    ("zamba2-untied", "zamba2", {"num_hidden_layers": 3, "layers_block_type": ["mamba", "hybrid",
     "hybrid"], "num_key_value_heads": 4, "use_shared_attention_adapter": True,
     "adapter_rank": 8, "n_mamba_heads": 8, "mamba_d_state": 8}),  # a block per hybrid layer
    (
        "minimax",  # lightning attention (decaying linear state) beside full attention, experts
        "minimax",
        {"num_hidden_layers": 4, "head_dim": 16, "num_local_experts": 6, "num_experts_per_tok": 2,
         "layer_types": ["linear_attention", "full_attention", "linear_attention",
                         "linear_attention"], "block_size": 8, "full_attn_alpha_factor": 1.1,
         "full_attn_beta_factor": 0.9, "linear_attn_alpha_factor": 0.8,
         "linear_attn_beta_factor": 1.2, "mlp_alpha_factor": 1.05, "mlp_beta_factor": 0.95},
    ),
    (
        "falcon-h1-rmsnorm",  # the grouped norm after the gate
        "falcon_h1",
        {**FALCON_H1, "mamba_rms_norm": True, "mamba_norm_before_gate": False},
    ),
    # Latent attention: DeepSeek-V3's own options (q LoRA, interleaved rope, yarn's mscale in
    # the softmax scale), and the q_proj path with plain rope.
    ("deepseek-v3", "deepseek_v3", {**DEEPSEEK, "q_lora_rank": 24, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 32}}),
    ("deepseek-v3-q-proj", "deepseek_v3",
     {**DEEPSEEK, "q_lora_rank": None, "rope_interleave": False}),
    # DeepSeek-V2: softmax routing within the 2 of 4 groups whose best expert leads; V2-Lite's
    # q_proj and plain greedy routing.
    ("deepseek-v2", "deepseek_v2", {**MLA_MOE, "first_k_dense_replace": 1,
     "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}),
    ("deepseek-v2-lite", "deepseek_v2", {**MLA_MOE, "first_k_dense_replace": 1,
     "q_lora_rank": None, "topk_method": "greedy"}),
    ("glm4-moe-lite", "glm4_moe_lite", {**MLA_MOE, "mlp_layer_types": ["dense", "sparse", "sparse"],
     "n_group": 2, "topk_group": 1}),
    ("youtu", "youtu", MLA),  # latent attention, dense MLPs
    ("sarvam-mla", "sarvam_mla", {**MLA_MOE, "first_k_dense_replace": 1, "n_group": 4,
     "topk_group": 2}),  # DeepSeek-V3's classes under its own model_type
    ("axk1", "axk1", {**MLA_MOE, "mlp_layer_types": ["dense", "sparse", "sparse"], "n_group": 4,
     "topk_group": 2}),  # the MoE output RMS-normed
    (
        "mistral4",  # grouped softmax routing; Llama 4's query scale grows every 8 positions
        "mistral4",
        {**MLA_MOE, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
         "original_max_position_embeddings": 8, "mscale_all_dim": 1.0, "mscale": 1.0,
         "llama_4_scaling_beta": 0.1, "partial_rotary_factor": 0.5}},
    ),
    ("minicpm3", "minicpm3", {**MLA, "scale_emb": 2.0, "scale_depth": 1.4, "dim_model_base": 32}),
    # Kimi Delta Attention (a decay per key channel) beside latent attention without RoPE.
    ("kimi-linear", "kimi_linear", KIMI_LINEAR),
    ("ling-hybrid", "bailing_hybrid", LING),
    ("ling-hybrid-q-lora", "bailing_hybrid",
     {**LING, "q_lora_rank": 24, "kda_safe_gate": False, "save_original_format": False}),
    # DeepSeek Sparse Attention: each query attends to the indexer's 8 best keys (every prompt
    # and continuation passes 8); V3.2's indexer rotates in halves, GLM-5's in pairs.
    ("deepseek-v32", "deepseek_v32", DSA),
    ("glm-moe-dsa", "glm_moe_dsa", DSA),
    # A.X-K2: the sparse block with a query-and-gate projection (the output gated per head),
    # gated RMSNorms, sigmoid routing in groups whose outsiders score 0.
    ("axk2", "axk2", {**DSA, "mlp_layer_types": ["dense", "sparse", "sparse"],
                      "gated_norm_rank": 8}),
    # LongCat-Flash: two latent-attention sublayers a block (LoRA scales on the query and the
    # latent), each with a dense MLP, and the shortcut MoE whose router also picks
    # zero-computation (identity) experts.
    ("longcat-flash", "longcat_flash", {**MLA, "num_hidden_layers": 4, "head_dim": 16,
     "n_routed_experts": 6, "zero_expert_num": 3, "moe_topk": 3,
     "expert_ffn_hidden_size": 32, "ffn_hidden_size": 64, "routed_scaling_factor": 2.0}),
    # MiMo-V2-Flash: values narrower than keys (24 vs 16, scaled), a third of each head rotated
    # with a RoPE base per layer type, sliding layers with twice the KV heads and sinks, experts
    # without a shared one after a dense first layer.
    ("mimo-v2-flash", "mimo_v2_flash", {"num_hidden_layers": 3, "head_dim": 24, "v_head_dim": 16,
     "sliding_window": 8, "layer_types": ["full_attention", "sliding_attention",
     "sliding_attention"], "n_routed_experts": 8, "num_experts_per_tok": 3,
     "moe_intermediate_size": 32, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.0}),
    # Falcon: one fused qkv in each of its three layouts, LayerNorms with biases, GeLU MLPs;
    # multi-query with attention and MLP side by side (7B), the new decoder architecture's KV
    # groups with a LayerNorm each (40B / 180B), and per-head qkv in sequence.
    ("falcon-7b", "falcon", {"multi_query": True, "parallel_attn": True}),
    ("falcon-40b", "falcon", {"new_decoder_architecture": True, "num_kv_heads": 2,
                              "bias": True}),
    ("falcon-sequential", "falcon", {"multi_query": False, "parallel_attn": False,
                                     "bias": True}),
    # Falcon-RW: ALiBi with 16 heads (slopes of 2^-0.5 steps, rounded to bf16 as HF does).
    ("falcon-rw", "falcon", {"alibi": True, "multi_query": False, "parallel_attn": False,
                             "bias": True, "hidden_size": 128, "num_attention_heads": 16}),
    # GPT-Neo: learned positions, attention without scale, global and 8-token local layers.
    ("gpt-neo", "gpt_neo", {"num_hidden_layers": 4, "attention_types": [[["global", "local"], 2]],
                            "window_size": 8}),
    # fairseq's decoder: scaled embeddings and positions offset by 2; XGLM's sinusoids (its
    # pad id 5 zeroes position 3's row, as transformers' table does), BioGPT's learned table
    # and its head named output_projection; tied and untied heads.
    ("xglm", "xglm", {"ffn_dim": 128, "pad_token_id": 5, "tie_word_embeddings": True}),
    ("biogpt", "biogpt", {"num_hidden_layers": 3}),
    ("biogpt-tied", "biogpt", {"tie_word_embeddings": True, "scale_embedding": False}),
    # ALiBi: BLOOM's slopes (6 heads: past the power of two, its extra slopes) with the
    # embedding norm, and with residuals from the norms' outputs; MPT's slopes (6 heads: odd
    # ones first), bias-free, q/k/v clamped, its own softmax scale.
    ("bloom", "bloom", {"n_head": 6, "hidden_size": 96}),
    ("bloom-post-ln-residual", "bloom", {"apply_residual_connection_post_layernorm": True}),
    ("mpt", "mpt", {"n_heads": 6, "hidden_size": 96,
                    "attn_config": {"clip_qkv": 0.3, "softmax_scale": 0.2}}),
    # GPT-NeoX-Japanese: q/k/v fused per head, a quarter of each head rotated, the last
    # layer's dense_bias.
    ("gpt-neox-japanese", "gpt_neox_japanese", {"num_hidden_layers": 3,
     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25}}),
    # ModernBERT's decoder: no norm before layer 0's attention, 8-token local layers with
    # their own RoPE base, a GeGLU fused in Wi, BERT's prediction head and the decoder's bias.
    ("modernbert-decoder", "modernbert-decoder", {"num_hidden_layers": 4, "local_attention": 16,
     "layer_types": ["full_attention", "sliding_attention"] * 2, "norm_bias": True,
     "pad_token_id": 0}),
    # DiffLlama: two attention passes over the value halves, paired query heads, a depth-
    # scheduled lambda (4 layers: each its own lambda_init).
    ("diffllama", "diffllama", {"num_hidden_layers": 4, "num_key_value_heads": 2}),
    # Dory: nGPT blocks, one input layer, a two-layer loop run twice (a cache per pass), one
    # output layer; sliding and full layers with a RoPE base each; logits scaled per token.
    ("dory", "dory", {"num_hidden_layers": 4, "n_input_layers": 1, "n_recurrent_layers": 2,
     "n_output_layers": 1, "n_recurrent_loops": 2, "head_dim": 16, "sliding_window": 8,
     "layer_types": ["sliding_attention", "full_attention"] * 2}),
    # GPT-1: post-LayerNorm blocks, no final norm, Conv1D weights with q/k/v fused.
    ("openai-gpt", "openai-gpt", {"n_positions": 128}),
    # Llama 4: chunked local attention (16-token chunks: every prompt crosses one) with complex
    # rotary and L2 QK-norm, NoPE layers with a query temperature that grows every 4 positions,
    # sigmoid-routed experts weighting their input (two per token) beside a shared expert.
    ("llama4", "llama4_text", {"num_hidden_layers": 4, "head_dim": 16,
     "no_rope_layer_interval": 2, "attention_chunk_size": 16, "floor_scale": 4,
     "attn_scale": 0.5, "interleave_moe_layer_step": 2, "num_local_experts": 4,
     "num_experts_per_tok": 2, "intermediate_size": 64, "intermediate_size_mlp": 128}),
]  # fmt: skip


CASE_BY_ID = {case_id: (model_type, overrides) for case_id, model_type, overrides in CASES}


def case_builder(case_by_id: dict[str, tuple[str, dict]]):
    """``built(case_id, tmp_path_factory)``: ``(folder, HF greedy tokens of PROMPTS)`` of one
    of ``case_by_id``'s cases, made once per module."""
    made: dict[str, tuple[object, list[list[int]]]] = {}

    def built(case_id, tmp_path_factory):
        if case_id not in made:
            model_type, overrides = case_by_id[case_id]
            folder = make_tiny_model(tmp_path_factory.mktemp(case_id), model_type, **overrides)
            made[case_id] = folder, hf_greedy(folder, PROMPTS, MAX_TOKENS)
        return made[case_id]

    return built


built = case_builder(CASE_BY_ID)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("case_id", list(CASE_BY_ID))
def test_tiny_model_matches_hf(tmp_path_factory, case_id):
    folder, expected = built(case_id, tmp_path_factory)
    llm = tiny_llm(folder)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


# The regimes run on the families whose layers differ most from Llama's: sliding windows with
# two RoPE bases and soft caps (Gemma 2/3), post-norm with windows (OLMo 3), length-dependent
# RoPE with partial rotary (Phi-3 longrope); a latent cache (DeepSeek-V3); experts; ALiBi
# (BLOOM); a loop of layers run twice, a cache per pass (Dory).
REGIME_CASES = [
    "gemma2", "gemma3-text", "gemma4-text", "olmo3", "phi3-longrope", "deepseek-v3", "qwen3-moe",
    "gpt-oss", "glm4-moe", "llama4", "deepseek-v32", "bloom", "dory",
]  # fmt: skip


@pytest.mark.parametrize("case_id", REGIME_CASES)
def test_regimes_match_hf(tmp_path_factory, case_id):
    """Chunked prefill, preemption (recompute and swap) and prefix-cache hits leave the greedy
    tokens exact."""
    folder, expected = built(case_id, tmp_path_factory)
    chunked = tiny_llm(folder, max_num_batched_tokens=8)
    assert token_ids(chunked.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    assert chunked.stats.num_chunked_prefills > 0

    # A pool that holds the longest request alone (every layer group counted), not all three.
    engine = tiny_llm(folder).llm_engine
    kv = engine.kv_cache_manager
    longest = max(len(p) for p in PROMPTS) + MAX_TOKENS
    num_blocks = kv.num_blocks_for(longest) + (kv.null_block is not None) + 1
    for swap_space, kind in ((0, "recompute"), (0.01, "swap")):
        small = tiny_llm(
            folder, kv_cache_memory=num_blocks * engine._kv_bytes_per_block(), swap_space=swap_space
        )
        assert token_ids(small.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
        stats = small.stats
        assert stats.num_preemptions > 0, kind
        assert getattr(stats, f"num_preemptions_{kind}") > 0

    cached = tiny_llm(folder)
    for _ in range(2):  # the second run finds the long prompt's full blocks cached
        assert token_ids(cached.generate(PROMPTS[1:2], GREEDY, use_tqdm=False)) == expected[1:2]
    assert cached.stats.prefix_cache_hits >= 32


SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}


# Seeded n > 1 sampling, as job fields (a worker's) and as SamplingParams (the engine's).
SEEDED = dict(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)


def check_seeded_samples(llm) -> None:
    """n > 1 with a seed gives the same three samples alone and in a batch, three different
    ones (three seeds, not one sample three times)."""
    seeded = SamplingParams(**SEEDED)
    alone = llm.generate(PROMPTS[1:2], seeded, use_tqdm=False)[0]
    batched = llm.generate(PROMPTS, seeded, use_tqdm=False)[1]
    samples = [c.token_ids for c in alone.outputs]
    assert len(samples) == 3 and samples == [c.token_ids for c in batched.outputs]
    assert len({tuple(s) for s in samples}) > 1


def check_json_schema(llm) -> None:
    """A greedy generation under ``SCHEMA`` stops on its own and validates."""
    import jsonschema

    params = SamplingParams(
        temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    out = llm.generate(PROMPTS[0:1], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.mark.parametrize(
    "case_id", ["gemma3-text", "phi3-longrope", "deepseek-v3", "qwen3-moe", "gpt-oss", "llama4"]
)
def test_seeded_samples_and_json_schema(tmp_path_factory, case_id):
    """n > 1 with a seed gives the same samples alone and in a batch; a JSON schema holds."""
    folder, _ = built(case_id, tmp_path_factory)
    llm = tiny_llm(folder)
    check_seeded_samples(llm)
    check_json_schema(llm)


def test_latent_cache_keeps_one_row_per_token_per_layer(tmp_path_factory):
    """A latent layer's bytes per token are (kv_lora_rank + qk_rope_head_dim) * elem, against
    2 * heads * (qk_nope + qk_rope) * elem for per-head K and V; the same budget holds that
    many times more blocks."""
    folder, _ = built("deepseek-v3", tmp_path_factory)
    llm = tiny_llm(folder)
    engine = llm.llm_engine
    assert llm.stats.kv_blocks_by_group == [("latent_attention", 0)]
    cfg, bs = engine.hf_config, engine.config.block_size
    layers, width = cfg.num_hidden_layers, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    num_blocks = engine.kv_cache_manager.block_pool.num_blocks
    assert [tuple(t.shape) for t in engine.kv_tensors] == [(num_blocks, bs, width)] * layers
    per_token_layer = engine._kv_bytes_per_block() // (bs * layers)
    assert per_token_layer == width * 4 == 192
    per_head = 2 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) * 4
    assert per_head == 1024
    assert num_blocks == 2**22 // (bs * layers * per_token_layer)


def test_chunked_layers_give_back_the_blocks_of_earlier_chunks(tmp_path_factory):
    """Llama 4's chunked layers keep the blocks of the query's own chunk only (16-token chunks
    of one block here), its NoPE layers every block; the tokens stay HF's (and under chunked
    prefill, preemption and prefix hits: the regimes above)."""
    folder, expected = built("llama4", tmp_path_factory)
    engine = tiny_llm(folder).llm_engine
    engine.add_request("long", PROMPTS[1], GREEDY)  # 33 + 20 tokens: 4 blocks
    held, tokens = [], []
    while engine.has_unfinished_requests():
        tokens = engine.step()[0].outputs[0].token_ids
        usage = dict(engine.get_stats().kv_blocks_by_group)
        held.append((usage["full_attention"], usage["attention_chunk_size=16"]))
    assert tokens == expected[1]
    # The prefill step holds the prompt's 3 blocks; each decode its own chunk's one block; the
    # request's end gives back everything.
    assert held[0] == (3, 3) and {c for _, c in held[1:-1]} == {1}
    assert held[-2][0] == 4 and held[-1] == (0, 0)


def test_unsupported_architecture_is_refused(tmp_path):
    folder = make_tiny_model(tmp_path / "m", "llama")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError):
        LLM(str(folder), dtype="float32", kv_cache_memory=2**22)


def mismatch_checkpoint(folder, change: str) -> None:
    """Break ``folder``'s checkpoint against its config: layer 1's ``down_proj`` of the wrong
    ``"shape"``, an ``"unknown"`` tensor beside it, or it ``"missing"``."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.mlp.down_proj.weight"
    if change == "shape":
        tensors[name] = tensors[name][:, :64].contiguous()
    elif change == "unknown":
        tensors[name.replace("down_proj", "extra_proj")] = tensors[name].clone()
    else:
        del tensors[name]
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "change,match",
    [
        ("shape", r"weight 'model\.layers\.1\.mlp\.down_proj\.weight': shape \(64, 64\)"),
        ("unknown", r"unexpected weight 'model\.layers\.1\.mlp\.extra_proj\.weight'"),
        ("missing", r"missing weights: \['layers\.1\.mlp\.down_proj\.weight'\]"),
    ],
)
def test_checkpoint_that_does_not_match_its_config_is_refused(tmp_path, change, match):
    folder = make_tiny_model(tmp_path / "m", "gemma2", **GEMMA, sliding_window=8)
    mismatch_checkpoint(folder, change)
    with pytest.raises(ValueError, match=match):
        tiny_llm(folder)


def test_gemma4_layers_that_share_kv_get_no_cache_of_their_own(tmp_path_factory):
    folder, _ = built("gemma4-text", tmp_path_factory)
    model = tiny_llm(folder).llm_engine.model
    # Layers 2 (sliding) and 3 (full) read the caches of layers 0 and 1.
    assert [s.page_shape for s in model.kv_cache_specs()] == [(2, 16), (1, 32)]
    assert model.kv_cache_indices() == [0, 1, 0, 1]
