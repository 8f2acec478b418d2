"""A multimodal checkpoint serves its text model (engine/multimodal.py): tiny Gemma 3, Gemma 4
12B, Mistral 3, Llama 3.2 Vision and Llama 4 wrappers (a vision tower and projector beside the
text decoder, saved by transformers itself) give the wrapper's own greedy tokens on text
prompts, the towers' weights unread; a wrapper around a text model pagedq does not run is
refused naming it."""

from __future__ import annotations

import pytest
import torch
from tiny_models import TINY, causal_lm_class, default_tokenizer
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from engine import LLM
from engine.model_loader import load_config, resolve_model
from engine.multimodal import text_weights
from tests.engine.test_architectures import (
    GREEDY,
    MAX_TOKENS,
    PROMPTS,
    hf_greedy,
    one_thread,  # noqa: F401
    tiny_llm,
    token_ids,
)

VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 2, "image_size": 28, "patch_size": 14}  # fmt: skip
WRAPPERS = {
    # Gemma 3 4B-27B: Gemma 3's text model beside a SigLIP tower
    "gemma3": {"text_config": {**TINY, "model_type": "gemma3_text", "head_dim": 16,
                               "sliding_window": 8, "layer_types": ["sliding_attention",
                                                                    "full_attention"]},
               "vision_config": {**VISION, "model_type": "siglip_vision_model"},
               "mm_tokens_per_image": 4},
    # Mistral Small 3.1 / 3.2: Mistral's text model beside a Pixtral tower
    "mistral3": {"text_config": {**TINY, "model_type": "mistral", "head_dim": 16},
                 "vision_config": {**VISION, "model_type": "pixtral", "head_dim": 16}},
    # Llama 4 Scout / Maverick: Llama 4's text model (chunked attention, experts) beside its
    # own vision tower
    "llama4": {"text_config": {**TINY, "model_type": "llama4_text", "head_dim": 16,
                               "attention_chunk_size": 16, "no_rope_layer_interval": 2,
                               "num_local_experts": 4, "intermediate_size": 64,
                               "intermediate_size_mlp": 128},
               "vision_config": {**VISION, "model_type": "llama4_vision_model",
                                 "vision_output_dim": 32, "projector_input_dim": 32,
                                 "projector_output_dim": 32}},
    # Gemma 4 12B ("unified"): Gemma 4's text layers (K = V global layers, KV shared across
    # layers) beside a patch embedder
    "gemma4_unified": {"text_config": {**TINY, "model_type": "gemma4_unified_text",
                                       "head_dim": 16, "global_head_dim": 32,
                                       "layer_types": ["sliding_attention", "full_attention"],
                                       "sliding_window": 8, "attention_k_eq_v": True},
                       "vision_config": {"model_type": "gemma4_unified_vision", "patch_size": 4,
                                         "mm_embed_dim": 32, "mm_posemb_size": 16,
                                         "output_proj_dims": 32}},
    # Llama 3.2 Vision (11B, 90B): Llama 3.1's layers with cross-attention layers to the image
    # among them, which a text prompt skips
    "mllama": {"text_config": {**TINY, "model_type": "mllama_text_model",
                               "num_hidden_layers": 4, "cross_attention_layers": [1, 3],
                               "pad_token_id": 0},
               "vision_config": {"model_type": "mllama_vision_model", "hidden_size": 32,
                                 "intermediate_size": 64, "num_hidden_layers": 2,
                                 "num_global_layers": 1, "attention_heads": 2,
                                 "vision_output_dim": 64, "image_size": 28, "patch_size": 14,
                                 "intermediate_layers_indices": [0]}},
}  # fmt: skip


def make_wrapper(folder, model_type: str, overrides: dict | None = None):
    """A random ``model_type`` wrapper saved by transformers, the default tokenizer beside."""
    kwargs = {**WRAPPERS[model_type], **(overrides or {})}
    kwargs["text_config"] = {**kwargs["text_config"], "vocab_size": len(default_tokenizer())}
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    model = causal_lm_class(model_type).from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
    model.save_pretrained(folder)
    default_tokenizer().save_pretrained(folder)
    if model_type in TEXT_MODEL_REFERENCE:
        model.language_model.save_pretrained(folder / "text")
        default_tokenizer().save_pretrained(folder / "text")
    return folder


# transformers 5.24's Llama 4 wrapper fails on text alone (its forward reads `image_outputs`
# of the text model's output): its own text model, saved alone, gives the reference tokens.
TEXT_MODEL_REFERENCE = {"llama4"}


@pytest.fixture(scope="module", params=sorted(WRAPPERS))
def wrapper(request, tmp_path_factory):
    folder = make_wrapper(tmp_path_factory.mktemp(request.param), request.param)
    reference = folder / "text" if request.param in TEXT_MODEL_REFERENCE else folder
    return request.param, folder, hf_greedy(reference, PROMPTS, MAX_TOKENS)


def test_a_multimodal_checkpoint_serves_its_text_model(wrapper):
    """The wrapper's text-only greedy tokens, with chunked prefill on a small budget too."""
    model_type, folder, expected = wrapper
    assert model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    config = load_config(resolve_model(str(folder)))
    assert config.wrapper_model_type == model_type
    assert config.model_type == WRAPPERS[model_type]["text_config"]["model_type"]
    for llm in (tiny_llm(folder), tiny_llm(folder, max_num_batched_tokens=8)):
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


def test_the_towers_weights_are_left_unread():
    """Both weight layouts map to the text model's names; the towers' are dropped."""
    names = [
        "language_model.model.layers.0.mlp.up_proj.weight", "language_model.lm_head.weight",
        "model.language_model.embed_tokens.weight", "lm_head.weight",
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
        "model.vision_tower.patch_conv.weight", "multi_modal_projector.linear_1.weight",
        "model.multi_modal_projector.mm_input_projection_weight",
    ]  # fmt: skip
    got = [name for name, _ in text_weights((n, None) for n in names)]
    assert got == ["model.layers.0.mlp.up_proj.weight", "lm_head.weight",
                   "model.embed_tokens.weight", "lm_head.weight"]  # fmt: skip


def test_a_wrapper_around_a_text_model_pagedq_does_not_run_is_refused(tmp_path):
    """Mistral 3 around an encoder-decoder (T5): refused at load naming the text model's type,
    before any weight is read (the folder has none)."""
    config = AutoConfig.for_model(
        "mistral3", text_config={"model_type": "t5", "d_model": 64, "num_layers": 1},
        vision_config={**VISION, "model_type": "pixtral", "head_dim": 16},
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    default_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type='t5'"):
        LLM(str(tmp_path), dtype="float32", kv_cache_memory=2**22)
