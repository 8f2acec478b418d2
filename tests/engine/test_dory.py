"""Dory's loop through the engine: every pass over the looped layers keeps a paged cache of its
own (its regimes run with ``test_architectures.py``'s ``REGIME_CASES``), and a checkpoint in the
released layout (attention and MLP as separate numbered blocks, ``mixer`` / ``attn_alpha`` /
``mlp_alpha``) loads to the same tokens."""

from __future__ import annotations

import re
import shutil

from safetensors.torch import load_file, save_file

from engine.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
from tests.engine.test_architectures import (
    GREEDY,
    PROMPTS,
    built,
    one_thread,  # noqa: F401
    tiny_llm,
    token_ids,
)

_OURS = re.compile(r"^(?:backbone|model)\.layers\.(\d+)\.(self_attn|mlp|lambda_1|lambda_2)")


def _released(name: str) -> str:
    """transformers' collapsed layer names -> the released two-blocks-per-layer names."""
    match = _OURS.match(name)
    if match is None:
        return name
    i, part = int(match[1]), match[2]
    block = {
        "self_attn": f"{2 * i}.mixer",
        "mlp": f"{2 * i + 1}.mixer",
        "lambda_1": f"{2 * i}.attn_alpha",
        "lambda_2": f"{2 * i + 1}.mlp_alpha",
    }[part]
    return f"backbone.layers.{block}" + name[match.end() :]


def test_each_pass_of_the_loop_keeps_its_own_cache(tmp_path_factory):
    """One input layer, two looped layers run twice, one output layer: six caches, the looped
    layers' modules shared between their passes; HF's tokens."""
    folder, expected = built("dory", tmp_path_factory)
    llm = tiny_llm(folder)
    model = llm.llm_engine.model
    assert len(model.layers) == 6
    assert model.layers[1] is model.layers[3] and model.layers[2] is model.layers[4]
    specs = model.kv_cache_specs()
    assert [type(s) for s in specs] == [
        SlidingWindowSpec, FullAttentionSpec, SlidingWindowSpec, FullAttentionSpec,
        SlidingWindowSpec, FullAttentionSpec,
    ]  # fmt: skip
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


def test_released_layout_loads_to_the_same_tokens(tmp_path_factory, tmp_path):
    folder, expected = built("dory", tmp_path_factory)
    released = tmp_path / "released"
    shutil.copytree(folder, released)
    tensors = load_file(str(released / "model.safetensors"))
    save_file({_released(k): v for k, v in tensors.items()}, str(released / "model.safetensors"))
    assert any(".mixer." in k for k in load_file(str(released / "model.safetensors")))
    llm = tiny_llm(released)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
