"""Tiny random checkpoints written as GGUF files at test time (no hub, no llama.cpp here).

``write_gguf`` lays a transformers model out as llama.cpp's converter does for the fields
transformers' GGUF reader reads back (``transformers.integrations.ggml.GGUF_CONFIG_MAPPING``,
``transformers.modeling_gguf_pytorch_utils``): the config as ``<arch>.*`` metadata, a small
byte-level BPE vocabulary as ``tokenizer.ggml.*``, and the tensors under gguf's own names, with
llama.cpp's transforms (Llama's q/k row permutation, Gemma 2/3's norms as ``1 + w``, experts
stacked as 3-D ``ffn_{gate,up,down}_exps``). Tensors are F32, so transformers reads back the
checkpoint bit for bit (Gemma 2/3's and Qwen3.5's norms to float32 rounding: the file holds
``1 + w``). Qwen3.5's layout is ``gguf_qwen3_5.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf_qwen3_5 import qwen35_array, qwen35_fields, qwen35_name

# transformers' model_type -> llama.cpp's architecture name
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",  # llama.cpp writes Mistral as a llama file
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma4_text": "gemma4",
    "gpt_oss": "gpt-oss",
    "qwen3_5_text": "qwen35",  # read by transformers' newer GGUF path (gguf_qwen3_5.py)
    "qwen3_5_moe_text": "qwen35moe",
}
QWEN35 = ("qwen35", "qwen35moe")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
# ggml token types: 1 normal, 3 control
NORMAL, CONTROL = 1, 3


def write_gguf(model, path: Path, quantize: bool = False) -> Path:
    """Write ``model`` (a transformers causal LM) with a ``config.vocab_size``-token byte-level
    BPE tokenizer as the GGUF file ``path``; ``quantize`` stores the matrices as Q8_0, as
    llama.cpp would (norms, biases and rows not a multiple of 32 stay F32)."""
    import gguf

    config = model.config
    arch = GGUF_ARCH[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    # transformers reads a llama file as Mistral only when general.name is exactly "mistral",
    # and then finds no "mistral" in gguf's architectures: a llama.cpp Mistral file reads as llama
    writer.add_name(f"tiny-{config.model_type}")
    for key, value in _config_fields(config, arch).items():
        _add_value(writer, key, value)
    _add_tokenizer(writer, config)
    for name, array in gguf_tensors(model, arch):
        if quantize and array.ndim >= 2 and array.shape[-1] % 32 == 0:
            q8_0 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(array, q8_0), raw_dtype=q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _config_fields(config, arch: str) -> dict:
    """``{<arch>.<key>: value}`` for every config field transformers' reader maps, read back
    from the config the way the reader writes it (the table inverted)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    if arch in QWEN35:
        return qwen35_fields(config, arch)
    model_type = config.model_type.removesuffix("_text")
    fields = {}
    for key, attr in GGUF_CONFIG_MAPPING[model_type].items():
        value = _config_value(config, attr) if attr else None
        if value is not None:
            fields[f"{arch}.{key}"] = value
    return fields


def _config_value(config, attr: str):
    if attr == "rope_theta":
        rope = config.rope_parameters
        return rope.get("full_attention", rope)["rope_theta"]
    if attr == "global_head_dim":  # Gemma 4 keeps the full layers' head size per layer
        per_layer = config.to_dict().get("per_layer_config") or {}
        return max((c.get("head_dim", 0) for c in per_layer.values()), default=None)
    return getattr(config, attr, None)


def _add_value(writer, key: str, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    else:
        raise TypeError(
            f"{key}={value!r}: only int, float, bool and list config values are written"
        )


def _add_tokenizer(writer, config) -> None:
    """A byte-level BPE vocabulary of ``config.vocab_size`` tokens: the special tokens, the
    256 bytes, then merges of letter pairs."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_tokens = list(bytes_to_unicode().values())
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    pairs = [(a, b) for a in letters for b in letters]
    num_merges = config.vocab_size - len(SPECIAL_TOKENS) - len(byte_tokens)
    if not 0 <= num_merges <= len(pairs):
        raise ValueError(f"vocab_size={config.vocab_size}: must be in [259, {259 + len(pairs)}]")
    pairs = pairs[:num_merges]
    tokens = SPECIAL_TOKENS + byte_tokens + [a + b for a, b in pairs]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL] * len(SPECIAL_TOKENS) + [NORMAL] * (len(tokens) - 3))
    writer.add_token_merges([f"{a} {b}" for a, b in pairs])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)


def gguf_tensors(model, arch: str):
    """``(gguf name, array)`` of each weight, transformed as llama.cpp stores it."""
    import gguf

    config = model.config
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    tied = config.tie_word_embeddings
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # a file without output.weight is read as tied
        array = tensor.detach().float().numpy()
        if ".experts." in hf_name and "_proj" in hf_name:  # fused 3-D experts
            yield from _expert_tensors(hf_name, array, arch)
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if arch in QWEN35:
            name = name or qwen35_name(hf_name)
            array = qwen35_array(name, array, config) if name else array
        if name is None:
            raise ValueError(f"{hf_name}: gguf has no {arch} tensor name for it")
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            array = _permute_rows(array, heads)
        elif arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            array = array + 1  # transformers reads Gemma 2/3 norms as w - 1
        elif name.endswith("ffn_gate_inp_shexp.weight"):
            array = array.reshape(-1)  # stored 1-D; transformers adds the row back
        yield name, np.ascontiguousarray(array)


def _permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary layout for q/k rows: each head's two halves interleaved."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _expert_tensors(hf_name: str, array: np.ndarray, arch: str):
    """transformers 5's fused experts as llama.cpp's three stacked ``*_exps`` tensors, each
    ``[experts, rows, columns]`` as a linear weight is."""
    prefix = f"blk.{hf_name.split('.')[2]}"
    if arch == "gpt-oss":  # [experts, in, out], gate and up interleaved, biases beside
        if hf_name.endswith("_bias"):
            gate, up = array[..., ::2], array[..., 1::2]
            kind = "bias"
        else:
            array = array.swapaxes(1, 2)
            gate, up = array[:, ::2], array[:, 1::2]
            kind = "weight"
        if "down_proj" in hf_name:
            yield f"{prefix}.ffn_down_exps.{kind}", np.ascontiguousarray(array)
            return
    elif hf_name.endswith("down_proj"):
        yield f"{prefix}.ffn_down_exps.weight", np.ascontiguousarray(array)
        return
    else:
        gate, up = np.split(array, 2, axis=1)  # [experts, 2 * intermediate, hidden]: gate first
        kind = "weight"
    yield f"{prefix}.ffn_gate_exps.{kind}", np.ascontiguousarray(gate)
    yield f"{prefix}.ffn_up_exps.{kind}", np.ascontiguousarray(up)


def hf_from_gguf(path: Path):
    """Hugging Face's model from the GGUF file ``path``, in fp32, dense."""
    from transformers import AutoModelForCausalLM, GgufConfig

    return AutoModelForCausalLM.from_pretrained(
        str(path.parent),
        gguf_file=path.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    ).eval()
