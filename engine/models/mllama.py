"""Llama 3.2 Vision's text model (``mllama_text_model``, 11B and 90B; the ``mllama`` multimodal
folders serve it): Llama 3.1's layers with cross-attention layers to the image among them
(``cross_attention_layers``). A text prompt has no image, and transformers skips those layers
when there is none: pagedq builds the self-attention layers alone and leaves the others' weights
unread. The embedding table has 8 rows past the vocabulary (the image tokens): only the text
rows are read, so an image token in a prompt is refused as any id past the vocabulary."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from engine.models.llama import LlamaForCausalLM

_LAYER = re.compile(r"^layers\.(\d+)\.")


class MllamaForCausalLM(LlamaForCausalLM):
    """The self-attention layers of Llama 3.2 Vision's text model."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        cross = set(config.cross_attention_layers or ())
        kept = [i for i in range(config.num_hidden_layers) if i not in cross]
        self.layers = nn.ModuleList(self.layers[i] for i in kept)
        # checkpoint layer index -> ours (None: a cross-attention layer, not read)
        self.layer_index = {i: None for i in cross} | {i: j for j, i in enumerate(kept)}

    def checkpoint_name(self, name: str) -> str | None:
        match = _LAYER.match(name)
        if match:
            ours = self.layer_index.get(int(match.group(1)))
            if ours is None:
                return None
            name = f"layers.{ours}.{name[match.end() :]}"
        return super().checkpoint_name(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        vocab = self.config.vocab_size
        super().load_weights(
            (name, t[:vocab] if name.endswith("embed_tokens.weight") else t) for name, t in weights
        )
