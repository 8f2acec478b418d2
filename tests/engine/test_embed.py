"""LLM.embed against Hugging Face: the same pooled, normalised final hidden states (fp32)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import LLM, SamplingParams

TEXTS = ["The capital of France is", "Embeddings of a tiny random model, pooled " * 6, "Hi"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    # A small token budget chunks the longest prompt: its mean pools over chunks.
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=24)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: str):
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_llama_dir)


def hf_embedding(hf, ids: list[int], pooling: str, dimensions: int | None = None) -> torch.Tensor:
    """Hugging Face's last_hidden_state (final norm applied), pooled, cut and normalised."""
    model, _ = hf
    with torch.no_grad():
        states = model(torch.tensor([ids])).last_hidden_state[0]
    vector = {"last": states[-1], "mean": states.mean(0), "cls": states[0]}[pooling]
    if dimensions is not None:
        vector = vector[:dimensions]
    return torch.nn.functional.normalize(vector, dim=-1)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embed_matches_hf(llm: LLM, hf, pooling: str) -> None:
    outs = llm.embed(TEXTS, pooling=pooling, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [1, 1, 1]
    for text, out in zip(TEXTS, outs):
        ids = hf[1].encode(text)
        assert out.prompt_token_ids == ids
        got = torch.tensor(out.outputs[0].embedding)
        torch.testing.assert_close(got, hf_embedding(hf, ids, pooling), atol=1e-5, rtol=0)
    assert llm.stats.num_running == 0
    assert llm.stats.num_free_blocks == llm.stats.num_blocks  # blocks freed as prefill ends


def test_embed_dimensions_and_token_ids(llm: LLM, hf) -> None:
    ids = hf[1].encode(TEXTS[0])
    out = llm.embed([ids], pooling="last", dimensions=16, use_tqdm=False)[0]
    assert len(out.outputs[0].embedding) == 16
    got = torch.tensor(out.outputs[0].embedding)
    torch.testing.assert_close(got, hf_embedding(hf, ids, "last", 16), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="dimensions: must be <= the model's hidden size 64"):
        llm.embed(["x"], dimensions=65, use_tqdm=False)


def test_embed_in_the_same_batch_as_generation(llm: LLM, hf) -> None:
    """Generations and embeddings share steps; neither changes the other."""
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate(TEXTS[:2], greedy, use_tqdm=False)
    engine.add_request("g0", TEXTS[0], greedy)
    engine.add_embedding_request("e0", TEXTS, llm_embed_params("mean"))
    engine.add_request("g1", TEXTS[1], greedy)
    done, steps_with_both = {}, 0
    while engine.has_unfinished_requests():
        running = {r.parent_id for r in engine.scheduler.running}
        steps_with_both += {"g0", "e0"} <= running
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert steps_with_both > 0
    assert [done[g].outputs[0].token_ids for g in ("g0", "g1")] == [
        a.outputs[0].token_ids for a in alone
    ]
    embedded = done["e0"]
    assert [o.index for o in embedded.outputs] == [0, 1, 2]
    for text, out in zip(TEXTS, embedded.outputs):
        ids = hf[1].encode(text)
        assert out.num_prompt_tokens == len(ids)
        torch.testing.assert_close(
            torch.tensor(out.embedding), hf_embedding(hf, ids, "mean"), atol=1e-5, rtol=0
        )


def llm_embed_params(pooling: str):
    from engine import PoolingParams

    return PoolingParams(pooling)


def test_checkpoint_pooling_config(tiny_llama_dir: str, tmp_path, hf) -> None:
    """A sentence-transformers folder's 1_Pooling/config.json decides the pooling."""
    folder = tmp_path / "st"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling",
                }
            ]
        )
    )
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True})
    )
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="4MiB")
    out = llm.embed(TEXTS[0], use_tqdm=False)[0]
    ids = hf[1].encode(TEXTS[0])
    torch.testing.assert_close(
        torch.tensor(out.outputs[0].embedding), hf_embedding(hf, ids, "mean"), atol=1e-5, rtol=0
    )
