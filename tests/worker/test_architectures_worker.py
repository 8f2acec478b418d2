"""Families beyond Llama through a real worker and Redis: a Gemma 3 (sliding and global layers,
two RoPE bases, Gemma's chat template), a Phi-3 with longrope (length-dependent rotary), a
DeepSeek-V3 (latent attention over a latent cache, grouped-sigmoid experts), a Qwen3.5
(hybrid linear attention: state slots beside paged KV), a Falcon-H1 (Mamba-2 beside attention
in every layer), a pure Mamba-2 LM (no attention layer: state slots and a block table that only
counts tokens), a Llama 4 (chunked local attention, its prompts in 8-token chunks), a
DeepSeek-V3.2 (sparse attention: the indexer's 8 best keys), a GPTQ llama (4-bit act-order weights
kept packed) and a Cohere2 (no native family: the default `--model-impl auto` serves it on the
Transformers modeling backend; sliding layers, full layers without RoPE), one worker each, all on
the module's Redis. Token-id prompts give Hugging Face's greedy tokens; a chat, seeded n > 1
samples and a JSON schema give what the offline engine gives."""

from __future__ import annotations

import json

import jsonschema
import pytest
from transformers import AutoConfig, AutoTokenizer
from worker_helpers import make_client

from engine import SamplingParams
from engine.models import model_impls
from engine.structured_outputs import StructuredOutputsParams
from tests.engine.test_architectures import (
    MAX_TOKENS,
    PROMPTS,
    SCHEMA,
    SEEDED,
    built,
    one_thread,  # noqa: F401
    tiny_llm,
)
from tests.engine.test_chat_templates import GEMMA_TEMPLATE, MESSAGES
from tests.engine.test_quantized import built as quantized_built
from tests.engine.test_transformers_backend import backend_case

pytestmark = pytest.mark.slow

CASES = [
    "gemma3-text", "phi3-longrope", "deepseek-v3", "qwen3-moe", "gpt-oss", "qwen3.5", "falcon-h1",
    "mamba2", "jamba", "llama4", "deepseek-v32", "bloom",
]  # fmt: skip
QUANTIZED = ["gptq-asym-act-order"]  # tests/engine/test_quantized.py's cases
BACKEND = ["cohere2"]  # tests/engine/test_transformers_backend.py's cases
ALL_CASES = CASES + QUANTIZED + BACKEND
# Flags of one case's worker: Falcon-H1's prompts arrive in 8-token chunks, so its SSM and conv
# states carry from step to step inside the worker.
WORKER_FLAGS = {
    "falcon-h1": ("--max-num-batched-tokens", "8"),
    "llama4": ("--max-num-batched-tokens", "8"),  # prefill chunks across its 16-token chunks
    "bloom": ("--max-num-batched-tokens", "8"),  # ALiBi's distances across prefill chunks
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each case's folder (Gemma's chat template added) and HF greedy tokens."""
    out = {}
    builders = dict.fromkeys(QUANTIZED, quantized_built) | dict.fromkeys(BACKEND, backend_case)
    for case_id in ALL_CASES:
        build = builders.get(case_id, built)
        folder, expected = build(case_id, tmp_path_factory)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.chat_template = GEMMA_TEMPLATE
        tokenizer.save_pretrained(folder)
        out[case_id] = folder, expected
    return out


@pytest.fixture(scope="module")
def workers(models, worker_factory):
    """One worker per case, started together (they load while the other loads)."""
    started = {
        case_id: worker_factory(
            f"q-{case_id}",
            f"w-{case_id}",
            "--dtype",
            "float32",
            "--num-threads",
            "1",
            "--block-size",
            "16",
            *WORKER_FLAGS.get(case_id, ()),
            model=str(folder),
        )  # fmt: skip
        for case_id, (folder, _) in models.items()
    }
    for w in started.values():
        w.wait_ready()
    return started


@pytest.mark.parametrize("case_id", ALL_CASES)
def test_worker_gives_hf_greedy_and_the_offline_engine(private_redis, models, workers, case_id):
    folder, expected = models[case_id]
    client = make_client(private_redis.url, f"q-{case_id}")
    greedy = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    job_ids = client.submit_many({"prompt": p, **greedy} for p in PROMPTS)
    chat_id = client.submit(messages=MESSAGES, temperature=0.0, max_tokens=8, ignore_eos=True)
    seeded_id = client.submit(prompt=PROMPTS[1], **SEEDED)
    json_id = client.submit(
        prompt=PROMPTS[0],
        temperature=0.0,
        max_tokens=60,
        structured_outputs={"json": SCHEMA},
    )
    results = [client.result(j, timeout=300) for j in job_ids]
    assert [r.token_ids for r in results] == expected, workers[case_id].log_tail()

    llm = tiny_llm(folder)
    chat = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert client.result(chat_id, timeout=300).token_ids == chat.outputs[0].token_ids

    offline = llm.generate(PROMPTS[1:2], SamplingParams(**SEEDED), use_tqdm=False)[0]
    got = client.result(seeded_id, timeout=300)
    assert [c.token_ids for c in got.choices] == [c.token_ids for c in offline.outputs]

    structured = client.result(json_id, timeout=300)
    assert structured.finish_reason == "stop"
    jsonschema.validate(json.loads(structured.text), SCHEMA)
    offline_json = llm.generate(
        PROMPTS[0:1],
        SamplingParams(
            temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA)
        ),
        use_tqdm=False,
    )[0]
    assert structured.text == offline_json.outputs[0].text
    client.close()


@pytest.mark.parametrize("case_id", BACKEND)
def test_a_backend_family_runs_through_the_worker_to_a_complete_result(
    private_redis, models, workers, case_id
):
    """A type only the Transformers backend claims: `auto` serves it there, and each job ends
    finished with HF's greedy tokens, its usage, model and worker filled in."""
    folder, expected = models[case_id]
    assert model_impls()[AutoConfig.from_pretrained(folder).model_type] == "transformers"
    client = make_client(private_redis.url, f"q-{case_id}")
    greedy = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    job_ids = client.submit_many({"prompt": p, **greedy} for p in PROMPTS)
    results = [client.result(j, timeout=300) for j in job_ids]
    log = workers[case_id].log_tail()
    assert [r.token_ids for r in results] == expected, log
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert (result.status, result.finish_reason, result.error) == ("finished", "length", None)
        assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (
            len(prompt),
            MAX_TOKENS,
        )
        assert result.worker == f"w-{case_id}" and result.model
    # The worker reports no model_impl (its status config and log name the model only), so the
    # path is pinned by the registry above and by HF's tokens from a type with no native file.
    assert workers[case_id].status()["config"]["model"] == results[0].model
    client.close()
