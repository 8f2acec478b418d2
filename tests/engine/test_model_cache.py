"""The GGUF model is parsed once, dequantized into an on-disk cache, and served from it after."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine import model_loader
from engine.model_loader import COMPLETE_MARKER, cached_source, load_tokenizer, resolve_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh model cache filled once from the default model's GGUF file."""
    cache_dir = tmp_path_factory.mktemp("model-cache")
    gguf = resolve_model("smollm2")
    reads_before = sum(model_loader.GGUF_READS.values())
    source = cached_source(gguf, cache_dir)
    return cache_dir, gguf, source, sum(model_loader.GGUF_READS.values()) - reads_before


def test_first_load_parses_the_gguf_file_once_and_fills_the_cache(cache):
    cache_dir, gguf, source, reads = cache
    assert reads == 1  # transformers alone parses it 4 times (config, tokenizer, model x2)
    [folder] = [p for p in cache_dir.iterdir()]
    assert source.gguf_file is None and source.folder == str(folder)
    assert folder.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    files = {p.name for p in folder.iterdir()}
    assert {COMPLETE_MARKER, "config.json", "model.safetensors", "tokenizer.json"} <= files
    assert not [p for p in cache_dir.iterdir() if ".tmp-" in p.name]


def test_second_load_reads_the_cache_not_the_gguf_file(cache):
    cache_dir, gguf, source, _ = cache
    reads_before = sum(model_loader.GGUF_READS.values())
    again = cached_source(gguf, cache_dir)
    assert again.folder == source.folder and again.gguf_file is None
    assert sum(model_loader.GGUF_READS.values()) == reads_before


def test_cached_weights_and_tokenizer_equal_the_gguf_ones(cache, hf_smollm2, chat_prompt_ids):
    _, _, source, _ = cache
    hf_model, hf_tok = hf_smollm2
    cached = load_file(f"{source.folder}/model.safetensors")
    expected = hf_model.state_dict()
    if hf_model.config.tie_word_embeddings:
        expected = {k: v for k, v in expected.items() if k != "lm_head.weight"}
    assert set(cached) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(cached[name], tensor), name
    tok = load_tokenizer(source)
    for text, ids in zip(["What is the capital of France?"], chat_prompt_ids):
        messages = [{"role": "user", "content": text}]
        got = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        got = list(got["input_ids"] if hasattr(got, "keys") else got)
        assert got == ids
    assert tok.decode(chat_prompt_ids[1]) == hf_tok.decode(chat_prompt_ids[1])
