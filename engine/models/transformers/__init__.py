"""The Transformers modeling backend (vLLM's name): a family pagedq has no file for runs on
transformers' own modules, with pagedq's paged attention plugged in through transformers'
``AttentionInterface``.

``attention.py`` is the attention function and the step context it reads; ``support.py`` what
the backend runs and what it refuses; ``weights.py`` the checkpoint loading; ``model.py`` the
model class, with the native ``CausalLM``'s protocol.
"""

from __future__ import annotations

# The model types the backend is verified on, each by a test of
# tests/engine/test_transformers_backend.py that gives Hugging Face's greedy tokens: the
# claim `pagedq models` lists. Other decoder-only attention families run too, unclaimed.
TRANSFORMERS_BACKEND_TYPES: tuple[str, ...] = (
    "apertus", "arcee", "cohere", "cohere2", "ernie4_5", "ernie4_5_moe", "exaone4", "glm", "glm4",
    "gpt_neox", "granite", "granitemoe", "helium", "hunyuan_v1_dense", "ministral", "ministral3",
    "nemotron", "olmo", "olmoe", "seed_oss", "smollm3", "stablelm", "starcoder2", "vaultgemma",
)  # fmt: skip

MODEL_CLASS = ("engine.models.transformers.model", "TransformersForCausalLM")
