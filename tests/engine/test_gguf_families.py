"""A GGUF file of each family that transformers reads from GGUF loads with
``LLM(model="file.gguf")`` and gives the greedy tokens of Hugging Face's model read from the same
file (fp32).

The files are tiny random checkpoints written at test time (``tests/gguf_files.py``). Where
transformers' reader takes a size from the config class's defaults instead of the file (it reads
only ``GGUF_CONFIG_MAPPING``'s keys), the checkpoint is built at that default, as a real file
of that family has it.
"""

from __future__ import annotations

import pytest
import torch
from gguf_files import hf_from_gguf, write_gguf
from tiny_models import tiny_hf_model

from engine import LLM, SamplingParams
from tests.engine.conftest import hf_greedy

VOCAB = 320  # the 3 special tokens, 256 bytes, 61 merges
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [[1, 104, 300, 72, 9, 250], [5, 77, 201, 12, 12, 300, 45, 8, 9, 10, 11] * 2]
EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2}
SLIDING_FULL = ["sliding_attention", "full_attention"]
QWEN3_5 = {
    "head_dim": 32, "layer_types": ["linear_attention", "full_attention"],
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}  # fmt: skip

# (model_type, config overrides of tests/tiny_models.TINY)
FAMILIES = {
    "llama": {},
    "mistral": {"seed": 1, "tie_word_embeddings": True},  # a file without output.weight
    "qwen2": {},
    "qwen3": {"head_dim": 128},  # Qwen3Config's: the reader reads no head size for qwen3
    # The reader reads no expert widths: Qwen2MoeConfig's 1408 / 5632, Qwen3MoeConfig's 768;
    # it sets norm_topk_prob for qwen3moe files, as llama.cpp runs them.
    "qwen2_moe": EXPERTS,
    "qwen3_moe": {**EXPERTS, "head_dim": 16, "norm_topk_prob": True},
    "phi3": {"pad_token_id": 0},  # Phi3Config's pad id 32000 is past this vocabulary
    # Gemma 2 files have no output.weight; the softmax scale is the default 256, not head_dim.
    "gemma2": {"head_dim": 16, "tie_word_embeddings": True, "sliding_window": 8},
    "gemma3_text": {"head_dim": 16, "sliding_window": 8, "layer_types": SLIDING_FULL},
    # The reader states Gemma 4's full-attention head size and takes Gemma4TextConfig's defaults
    # for the rest: sliding heads of 256, per-layer inputs 256 wide over 262144 tokens, the layer
    # pattern, no KV sharing, no MoE block. One (full) layer keeps that table to 268 MB.
    "gemma4_text": {"num_hidden_layers": 1, "global_head_dim": 32, "tie_word_embeddings": True},
    # Hybrid linear attention, read by transformers' newer GGUF path (llama.cpp's qwen35 files:
    # value heads tiled, -exp(A_log), 1 + w norms); 8 rotary dims make the 3 mrope sections.
    "qwen3_5_text": QWEN3_5,
    "qwen3_5_moe_text": {
        **QWEN3_5,
        **EXPERTS,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    },
}
# Tied and scaled by sqrt(hidden_size), wide embeddings make each token its own likeliest
# successor: the greedy tokens would repeat the last prompt token.
NARROW_EMBEDDINGS = ("gemma2", "gemma4_text")
SKIPS = {
    "gpt_oss": (
        "transformers 5.24's reader maps no gpt-oss expert tensor (ffn_{gate,up,down}_exps, "
        "weights and biases): it leaves the experts at random init; pagedq refuses such a file "
        "(test_gguf_file_transformers_reads_incompletely_is_refused)"
    ),
}
# llama.cpp writes Mistral as a llama file, and transformers reads it so (a file whose
# general.name is exactly "mistral" is read as Mistral, and then its weights fail to map: gguf
# has no "mistral" architecture).
READ_AS = {"mistral": "llama"}
CASES = [*FAMILIES, *(pytest.param(t, marks=pytest.mark.skip(reason=r)) for t, r in SKIPS.items())]


@pytest.fixture(autouse=True, scope="module")
def one_thread_and_own_cache(tmp_path_factory):
    """One thread (tiny models on a shared 2-core host), and a model cache of this module's own
    for the dequantized files."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDQ_CACHE_DIR", str(tmp_path_factory.mktemp("model-cache")))
        yield
    torch.set_num_threads(saved)


_FILES: dict[str, tuple[object, object]] = {}


def gguf_file(model_type, tmp_path_factory, quantize=False, **overrides):
    """``(path, original model)`` of a family's tiny GGUF file (``quantize``: Q8_0 matrices),
    written once per module."""
    key = f"{model_type}-q8_0" if quantize else model_type
    if key not in _FILES:
        config = {"vocab_size": VOCAB, **FAMILIES.get(model_type, {}), **overrides}
        model = tiny_hf_model(model_type, **config)
        if model_type in NARROW_EMBEDDINGS:
            with torch.no_grad():
                model.model.embed_tokens.weight.mul_(0.15)
        path = tmp_path_factory.mktemp("gguf") / f"tiny-{key}.gguf"
        _FILES[key] = write_gguf(model, path, quantize), model
    return _FILES[key]


@pytest.mark.parametrize("model_type", CASES)
def test_transformers_reads_the_file_back(tmp_path_factory, model_type):
    """The file holds the checkpoint: transformers reads back its type, sizes and weights (the
    norms Gemma 2/3 and Qwen3.5 files hold as 1 + w to float32 rounding)."""
    path, model = gguf_file(model_type, tmp_path_factory)
    hf = hf_from_gguf(path)
    assert hf.config.model_type == READ_AS.get(model_type, model_type)
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert getattr(hf.config, field) == getattr(model.config, field), field
    got, want = hf.state_dict(), model.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("model_type", CASES)
def test_gguf_file_matches_hf(tmp_path_factory, model_type):
    path, _ = gguf_file(model_type, tmp_path_factory)
    assert_matches_hf(path, model_type)


# Q8_0 through both of transformers' readers: the older one dequantizes with gguf's numpy code,
# the newer one (Qwen3.5) with its own, before un-tiling the value heads.
@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_5_text"])
def test_quantized_gguf_file_matches_hf(tmp_path_factory, model_type):
    path, _ = gguf_file(model_type, tmp_path_factory, quantize=True)
    assert_matches_hf(path, model_type)


def assert_matches_hf(path, model_type):
    """``LLM(model=path)`` gives the greedy tokens of Hugging Face's model from the file."""
    hf = hf_from_gguf(path)
    expected = [hf_greedy(hf, prompt, MAX_TOKENS, eos_token_id=None) for prompt in PROMPTS]
    llm = LLM(str(path), dtype="float32", kv_cache_memory=2**22, block_size=16, num_threads=1)
    assert llm.llm_engine.hf_config.model_type == READ_AS.get(model_type, model_type)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_gguf_file_transformers_reads_incompletely_is_refused(tmp_path_factory):
    """gpt-oss: transformers' reader would run the experts at random init; pagedq says which
    weights the file does not give instead."""
    config = {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64}
    path, _ = gguf_file("gpt_oss", tmp_path_factory, head_dim=64, sliding_window=8, **config)
    with pytest.raises(
        ValueError,
        match=r"no tensor in the file for 8 weights of "
        r"model_type='gpt_oss' \(first: \['model\.layers\.0\.mlp\.experts",
    ):
        LLM(str(path), dtype="float32", kv_cache_memory=2**22)
