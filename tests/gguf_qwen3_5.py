"""Qwen3.5's GGUF layout, for ``tests/gguf_files.py``: llama.cpp's ``qwen35`` / ``qwen35moe``
files as transformers' newer GGUF path reads them back (``transformers.integrations.gguf``:
``_qwen35_config`` for the metadata, ``_qwen35`` / ``_qwen35moe`` for the weights)."""

from __future__ import annotations

import numpy as np

# Zero-centred norms llama.cpp stores as 1 + w (the linear attention's own norm is not one).
OFFSET_NORMS = ("output_norm", "attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm")


def qwen35_fields(config, arch: str) -> dict:
    """``{<arch>.<key>: value}``: the metadata ``_qwen35_config`` rebuilds the config from."""
    # the file states the layer pattern as "every n-th layer is full attention"
    interval = config.layer_types.index("full_attention") + 1
    pattern = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
               for i in range(config.num_hidden_layers)]  # fmt: skip
    if pattern != config.layer_types:
        raise ValueError(f"layer_types={config.layer_types}: not one full layer in {interval}")
    rotary_dim = int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
    half = rotary_dim // 2
    fields = {
        "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size,
        "block_count": config.num_hidden_layers,
        "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "attention.key_length": config.head_dim,
        "attention.layer_norm_rms_epsilon": config.rms_norm_eps,
        "full_attention_interval": interval,
        "ssm.conv_kernel": config.linear_conv_kernel_dim,
        "ssm.state_size": config.linear_key_head_dim,
        "ssm.group_count": config.linear_num_key_heads,
        "ssm.time_step_rank": config.linear_num_value_heads,
        "ssm.inner_size": config.linear_value_head_dim * config.linear_num_value_heads,
        "rope.freq_base": config.rope_parameters["rope_theta"],
        "rope.dimension_count": rotary_dim,
        # Text positions are equal on the three axes, so any split of the frequencies is plain
        # RoPE; transformers keeps the non-zero sections and needs three.
        "rope.dimension_sections": [half - 2 * (half // 3), half // 3, half // 3, 0],
    }
    if arch == "qwen35moe":
        fields |= {
            "expert_feed_forward_length": config.moe_intermediate_size,
            "expert_shared_feed_forward_length": config.shared_expert_intermediate_size,
            "expert_count": config.num_experts,
            "expert_used_count": config.num_experts_per_tok,
        }
    return {f"{arch}.{key}": value for key, value in fields.items()}


def qwen35_name(hf_name: str) -> str | None:
    """The one tensor gguf's name map does not know."""
    if hf_name.endswith("linear_attn.dt_bias"):
        return f"blk.{hf_name.split('.')[2]}.ssm_dt.bias"
    return None


def qwen35_array(name: str, array: np.ndarray, config) -> np.ndarray:
    """``array`` as llama.cpp stores the tensor ``name``: offset norms, ``-exp(A_log)``, a 2-D
    conv kernel, and value heads tiled (``v0k0 v0k1 v1k0 ...``) where transformers groups them
    by key head (``v0k0 v1k0 v0k1 ...``)."""
    leaf = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
    if name.endswith(".ssm_a"):
        leaf = "ssm_a"
    if leaf in OFFSET_NORMS:
        return array + 1
    keys, values = config.linear_num_key_heads, config.linear_num_value_heads
    per_head = _tiled_order(keys, values // keys, 1)
    per_value = _tiled_order(keys, values // keys, config.linear_value_head_dim)
    qk_rows = 2 * config.linear_key_head_dim * keys
    if leaf == "ssm_a":
        return -np.exp(array)[per_head]
    if leaf in ("ssm_dt", "ssm_alpha", "ssm_beta"):
        return array[per_head]
    if leaf == "attn_gate":
        return array[per_value]
    if leaf in ("attn_qkv", "ssm_conv1d"):
        array = np.concatenate([array[:qk_rows], array[qk_rows:][per_value]])
        return array.reshape(array.shape[0], -1)  # the conv kernel [channels, 1, k] as 2-D
    if leaf == "ssm_out":
        return array[:, per_value]
    return array


def _tiled_order(num_key_heads: int, heads_per_key: int, head_dim: int) -> np.ndarray:
    """Indices taking grouped rows to llama.cpp's tiled order."""
    grouped = np.arange(num_key_heads * heads_per_key * head_dim)
    return grouped.reshape(num_key_heads, heads_per_key, head_dim).swapaxes(0, 1).reshape(-1)
