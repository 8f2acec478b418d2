"""Which unclaimed causal-LM types run on the Transformers modeling backend: for each
``model_type`` transformers has a causal LM for and pagedq neither serves natively nor claims,
a tiny random checkpoint (``tests/tiny_models.py``'s ``TINY``, with the overrides below), Hugging
Face's greedy tokens against pagedq's (``model_impl="transformers"``, fp32) on the prompts of
``tests/engine/test_architectures.py``.

    python bench/backend_survey.py                      # every unclaimed type
    python bench/backend_survey.py --types gemma,gpt2   # some (claimed ones too)
    python bench/backend_survey.py --timeout 60 --seed 1

One line per type: ``ok``, ``mismatch (prompt p, position i)`` (the first differing token),
``refused: <message>`` (pagedq's ValueError at load), ``error: <exception>`` (anything else,
HF's side included), or ``skipped: <why>`` (encoder, encoder-decoder, multimodal: out of the
backend's scope). One process, one thread, one type at a time, each under ``--timeout``
seconds (SIGALRM: a type stuck inside one C call outlives it).
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

SLIDING_FULL = ["sliding_attention", "full_attention"]
WINDOW = 8
# The first field present of each group is set: experts 8, 3 routed per token, small experts.
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "moe_k", "moe_topk", "num_experts_per_token")
EXPERT_SIZE_FIELDS = (
    "moe_intermediate_size", "expert_intermediate_size", "expert_ffn_hidden_size", "ffn_hidden_size"
)  # fmt: skip
TINY_HEADS = 4  # TINY's num_attention_heads
# Multi-head latent attention, small.
MLA = {"kv_lora_rank": 32, "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
       "v_head_dim": 16, "qk_head_dim": 24}  # fmt: skip
# What a family needs beyond the generic overrides (``tiny_overrides``).
OVERRIDES: dict[str, dict] = {
    "mpt": {"d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 512,
            "attn_config": {"alibi": True}},
    "falcon": {"new_decoder_architecture": True, "num_kv_heads": 2, "alibi": False},
    "dbrx": {"d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 512,
             "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"moe_num_experts": 8, "moe_top_k": 3, "ffn_hidden_size": 32}},
    "dots3_note_text": {"num_key_value_heads": 4},  # its config asks for MHA
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": WINDOW},
    "inkling2_text": {"unpadded_vocab_size": None},
    "inkling2_loop_text": {"unpadded_vocab_size": None},
    "zaya": {"num_experts_per_tok": 1},  # the only routing it supports
    "llama4_text": {"intermediate_size_mlp": 128, "interleave_moe_layer_step": 1,
                    "num_local_experts": 8, "num_experts_per_tok": 1,
                    "no_rope_layers": [1, 0], "attention_chunk_size": 8},
}  # fmt: skip
# Sub-configs of composite models: the backend runs text decoders only.
MULTIMODAL_SUBCONFIGS = ("vision", "audio", "speech", "encoder", "image", "depth", "decoder")


def candidate_types() -> list[str]:
    """transformers' causal-LM types pagedq neither serves natively nor claims."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from engine.models import model_impls

    return sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(model_impls()))


def out_of_scope(model_type: str, config) -> str | None:
    """Why ``model_type`` is not a decoder-only text LM (None: it is)."""
    from transformers.models.auto import modeling_auto as auto

    if getattr(config, "is_encoder_decoder", False):
        return "config.is_encoder_decoder"
    if model_type in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return "the decoder of an encoder-decoder family"
    if model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "an encoder (masked LM) family"
    if model_type in auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
        return "a speech encoder-decoder family"
    subs = [k for k in (getattr(config, "sub_configs", None) or {}) if k != "text_config"]
    if any(s.startswith(MULTIMODAL_SUBCONFIGS) for s in subs) or "text_config" in (
        getattr(config, "sub_configs", None) or {}
    ):
        return f"composite (multimodal) config: sub-configs {sorted(config.sub_configs)}"
    name = auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    if name.endswith("ForConditionalGeneration"):
        return f"{name} (multimodal)"
    return None


def tiny_overrides(model_type: str, config, vocab_size: int) -> dict:
    """Overrides of ``TINY`` that fit ``model_type``'s default ``config``: head size 16,
    windows of 8, experts 8 with 3 per token, small MLA ranks, a pad id inside the vocabulary."""
    fields = config.to_dict()
    o: dict = {}
    if "head_dim" in fields:
        o["head_dim"] = 16
    if "rotary_dim" in fields:  # GPT-J, CodeGen: partial RoPE
        o["rotary_dim"] = 8
    if "sliding_window" in fields:
        o["sliding_window"] = WINDOW
    if "use_sliding_window" in fields:
        o["use_sliding_window"] = True
    layer_types = fields.get("layer_types") or []
    if "sliding_attention" in layer_types and set(layer_types) <= set(SLIDING_FULL):
        o["layer_types"] = SLIDING_FULL
    for group, value in ((EXPERT_FIELDS, 8), (TOP_K_FIELDS, 3), (EXPERT_SIZE_FIELDS, 32)):
        present = [f for f in group if f in fields]
        if present:
            o[present[0]] = value
    if "n_shared_experts" in fields and fields["n_shared_experts"] is None:
        o["n_shared_experts"] = 1
    if "first_k_dense_replace" in fields:  # layer 0 dense, layer 1 experts
        o["first_k_dense_replace"] = 1
    if "kv_lora_rank" in fields:  # MLA: every head its own latent K/V, RoPE on 8 dims
        o.update({k: v for k, v in MLA.items() if k in fields})
        o["num_key_value_heads"] = TINY_HEADS
        if "head_dim" in fields:  # MLA families name the RoPE part so
            o["head_dim"] = MLA["qk_rope_head_dim"]
    for group in ("n_group", "topk_group"):
        if group in fields:
            o[group] = 1
    pad = fields.get("pad_token_id")
    if isinstance(pad, int) and pad >= vocab_size:
        o["pad_token_id"] = 0
    return {**o, **OVERRIDES.get(model_type, {})}


def first_difference(want: list[list[int]], got: list[list[int]]) -> str:
    for p, (w, g) in enumerate(zip(want, got)):
        for i, (a, b) in enumerate(zip(w, g)):
            if a != b:
                return f"prompt {p}, position {i}: HF {a}, pagedq {b}"
    return "lengths differ"


class Timeout(BaseException):  # not caught by the `except Exception` of a type
    pass


def _alarm(signum, frame):
    raise Timeout()


def survey_one(model_type: str, seed: int, folder: Path) -> str:
    """The survey's line for one type."""
    from tiny_models import default_tokenizer, make_tiny_model
    from transformers import AutoConfig

    from tests.engine.test_architectures import (
        GREEDY,
        MAX_TOKENS,
        PROMPTS,
        hf_greedy,
        tiny_llm,
        token_ids,
    )

    try:
        config = AutoConfig.for_model(model_type)
    except Exception as e:  # noqa: BLE001
        return f"error: config: {type(e).__name__}: {e}"
    if why := out_of_scope(model_type, config):
        return f"skipped: {why}"
    overrides = tiny_overrides(model_type, config, len(default_tokenizer()))
    try:
        make_tiny_model(folder, model_type, seed=seed, **overrides)
        want = hf_greedy(str(folder), PROMPTS, MAX_TOKENS)
    except Exception as e:  # noqa: BLE001
        return f"error: HF: {type(e).__name__}: {_short(e)}"
    try:
        llm = tiny_llm(folder, model_impl="transformers")
        got = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    except ValueError as e:
        return f"refused: {_short(e)}"
    except Exception as e:  # noqa: BLE001
        where = traceback.extract_tb(e.__traceback__)[-1]
        return (
            f"error: {type(e).__name__}: {_short(e)} ({Path(where.filename).name}:{where.lineno})"
        )
    return "ok" if got == want else f"mismatch ({first_difference(want, got)})"


def _short(e: Exception, n: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= n else text[:n] + "..."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", help="comma-separated model types (default: every unclaimed)")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per type")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)

    import logging

    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    hf_logging.disable_progress_bar()
    types = args.types.split(",") if args.types else candidate_types()
    from kernels.cpu_attention import cpu_kernels_available

    cpu_kernels_available()  # a (re)build of the C++ kernels here, not in the first type's time
    signal.signal(signal.SIGALRM, _alarm)
    for model_type in types:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            signal.alarm(args.timeout)
            try:
                line = survey_one(model_type, args.seed, Path(tmp))
            except Timeout:
                line = f"error: timed out after {args.timeout} s"
            finally:
                signal.alarm(0)
        print(f"{model_type:28s} {line}  [{time.perf_counter() - start:.1f} s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
