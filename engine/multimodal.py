"""The text decoder of a multimodal checkpoint: Gemma 3 (4B to 27B), Mistral Small 3.1 / 3.2,
Llama 4 and others ship their text model inside a wrapper beside a vision or audio tower.
pagedq generates text from text prompts, so such a folder serves its text model: the wrapper's
``text_config`` (the quantization config carried over), and the weights under the text model's
names, the towers and projectors left unread.

A wrapper is a config with a ``text_config`` and a tower (``MULTIMODAL_FIELDS``) whose own
``model_type`` pagedq does not run natively.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

# Sub-configs of the towers beside a text decoder (and of encoder-decoder models).
MULTIMODAL_FIELDS = ("vision_config", "audio_config", "speech_config", "encoder_config")
# A wrapper's weight names -> the text model's: transformers 4's layout (``language_model.model.``,
# ``language_model.lm_head.``), transformers 5's (``model.language_model.``, ``lm_head.``), in
# the order they are tried.
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("language_model.", "model."),
    ("lm_head.", "lm_head."),
)


def is_wrapper(config) -> bool:
    """True for a multimodal wrapper whose text model pagedq serves in its place."""
    from engine.models import MODEL_REGISTRY

    return (
        getattr(config, "text_config", None) is not None
        and any(getattr(config, name, None) is not None for name in MULTIMODAL_FIELDS)
        and config.model_type not in MODEL_REGISTRY
    )


def text_config_of(config):
    """``config``'s text decoder config where ``config`` is a wrapper, else ``config``; the
    text config gets the wrapper's ``model_type`` as ``wrapper_model_type``, its
    ``tie_word_embeddings`` (transformers ties the wrapper's LM head by the wrapper's flag) and
    its quantization config where it has none of its own."""
    if not is_wrapper(config):
        return config
    text = config.text_config
    text.wrapper_model_type = config.model_type
    if hasattr(config, "tie_word_embeddings"):
        text.tie_word_embeddings = config.tie_word_embeddings
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None and getattr(text, "quantization_config", None) is None:
        text.quantization_config = quantization
    return text


def text_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A wrapper's named tensors as the text model's; the towers' are dropped."""
    for name, tensor in weights:
        for prefix, ours in _TEXT_PREFIXES:
            if name.startswith(prefix):
                yield ours + name.removeprefix(prefix), tensor
                break
