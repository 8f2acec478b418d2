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
    "afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "beam", "bert-generation",
    "bitnet", "codegen",
    "cohere", "cohere2", "cohere2_moe", "cohere_compass_text", "ctrl", "cwm", "dbrx", "dots1",
    "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe", "flex_olmo", "flint", "gemma",
    "glm", "glm4", "gpt-sw3", "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "granite", "granite_swa",
    "granitemoe", "granitemoe_swa", "granitemoeshared", "helium", "hunyuan_v1_dense",
    "hunyuan_v1_moe", "hy_v3", "hyperclovax", "internlm3", "iquestcoder", "jais2", "jetmoe",
    "kolibri1", "laguna", "mellum", "minimax_m2", "minimax_m3_vl_text", "ministral", "ministral3",
    "nanochat", "nemotron", "olmo", "olmoe", "opt", "persimmon", "phi", "phimoe", "sarvam_moe",
    "seed_oss", "smollm3", "solar_open", "stablelm", "starcoder2", "vaultgemma",
)  # fmt: skip

MODEL_CLASS = ("engine.models.transformers.model", "TransformersForCausalLM")
