"""Structured outputs on the real default model: schemas people use, regex, choice, grammar,
JSON objects; n > 1, preemption, failures alone, forced tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams, StructuredOutputsParams
from tests.engine.test_swap import SMOLLM2_BLOCK_BYTES

SCHEMAS = {
    "person": {  # nested object, bounded integer, string patterns
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "email", "address"],
        "additionalProperties": False,
    },
    "tags": {  # array with minItems / maxItems
        "type": "object",
        "properties": {
            "topic": {"type": "string", "maxLength": 20},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "minItems": 2,
                "maxItems": 4,
            },
        },
        "required": ["topic", "tags"],
        "additionalProperties": False,
    },
    "sentiment": {  # enum, number with bounds
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["sentiment", "confidence"],
        "additionalProperties": False,
    },
    "movie": {  # anyOf with null, an optional field
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "year": {
                "anyOf": [{"type": "integer", "minimum": 1900, "maximum": 2030}, {"type": "null"}]
            },
            "director": {"type": "string", "maxLength": 30},
        },
        "required": ["title", "year"],
        "additionalProperties": False,
    },
    "list": {  # an array at the root
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "item": {"type": "string", "maxLength": 15},
                "qty": {"type": "integer", "minimum": 1, "maximum": 99},
            },
            "required": ["item", "qty"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
}
PROMPTS = {
    "person": "Invent a person and give their name, age, email and address as JSON.",
    "tags": "Give a topic and a few tags about cooking, as JSON.",
    "sentiment": "What is the sentiment of 'I love this phone'? Answer in JSON.",
    "movie": "Name a famous movie with its year and director, as JSON.",
    "list": "Write a short shopping list as a JSON array of items with quantities.",
}
NAMES = list(SCHEMAS)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def json_params(name: str, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 96)
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMAS[name]), **kw)


def token_ids(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", dtype="float32", kv_cache_memory="256MiB")


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.95, "seed": 7}]
)
def test_schemas_people_use_validate_greedy_and_sampled(llm, sampling):
    chats = [chat(PROMPTS[n]) for n in NAMES]
    outs = llm.chat(chats, [json_params(n, **sampling) for n in NAMES], use_tqdm=False)
    stopped = 0
    for name, out in zip(NAMES, outs):
        c = out.outputs[0]
        assert c.finish_reason in ("stop", "length"), c
        if c.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(c.text), SCHEMAS[name])
            assert c.num_forced_tokens > 0  # fixed keys and separators cost no decode step
    assert stopped >= 4


def test_regex_choice_json_object_and_grammar(llm):
    cases = [
        (StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"), "Make up a phone number."),
        (StructuredOutputsParams(regex=r"(Paris|Lyon|Nice)\."), "What is the capital of France?"),
        (StructuredOutputsParams(choice=["yes", "no", "it depends"]), "Is the sky blue?"),
        (
            StructuredOutputsParams(json_object=True),
            'Answer in JSON as {"capital": ...}: what is the capital of France?',
        ),
        (
            StructuredOutputsParams(grammar='start: "The answer is " NUMBER "."\nNUMBER: /[0-9]+/'),
            "What is 12 times 7?",
        ),
        (StructuredOutputsParams(grammar='root ::= ("red" | "green" | "blue") "!"'), "A color?"),
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=64, structured_outputs=so) for so, _ in cases
    ]
    outs = llm.chat([chat(text) for _, text in cases], params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), texts
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", texts[0])
    assert texts[1] in ("Paris.", "Lyon.", "Nice.")
    assert texts[2] in ("yes", "no", "it depends")
    assert isinstance(json.loads(texts[3]), dict)
    assert re.fullmatch(r"The answer is [0-9]+\.", texts[4])
    assert texts[5] in ("red!", "green!", "blue!")
    # A choice is one forced run once its first token is sampled.
    assert outs[2].outputs[0].num_forced_tokens >= 0


def test_n_samples_each_have_their_own_matcher_and_seed(llm):
    params = json_params("movie", n=3, seed=11, temperature=1.0, max_tokens=48)
    together = llm.chat([chat(PROMPTS["movie"])], params, use_tqdm=False)[0].outputs
    assert len({tuple(c.token_ids) for c in together}) > 1  # really different samples
    for c in together:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMAS["movie"])
    # Sample k is seeded with seed + k: alone, sample 2 gives the very same tokens.
    alone = json_params("movie", seed=13, temperature=1.0, max_tokens=48)
    again = llm.chat([chat(PROMPTS["movie"])], alone, use_tqdm=False)[0].outputs[0]
    assert again.token_ids == together[2].token_ids


def test_unconstrained_rows_are_untouched_and_a_bad_grammar_fails_alone(llm):
    engine = llm.llm_engine
    plain = SamplingParams(temperature=0, max_tokens=24)
    prompts = ["The capital of France is", "Once upon a time"]
    alone = token_ids(llm.generate(prompts, plain, use_tqdm=False))
    # Larger than the cheap synchronous check covers: it fails on the compile pool.
    bad_schema = {
        "type": "array",
        "uniqueItems": True,
        "items": {"type": "string", "description": "padding " * 3000},
    }
    for i, p in enumerate(prompts):
        engine.add_request(f"plain{i}", p, plain)
    engine.add_request(
        "bad", "List fruits", SamplingParams(structured_outputs={"json": bad_schema})
    )
    engine.add_request(
        "good",
        engine.prompts.apply_chat_template(chat(PROMPTS["sentiment"])),
        json_params("sentiment", temperature=0),
    )
    done, failed = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        failed.update(engine.pop_failed_requests())
    assert list(failed) == ["bad"]
    assert 'structured_outputs.json: Unimplemented keys: ["uniqueItems"]' in failed["bad"]
    assert done["bad"].outputs[0].finish_reason == "abort"
    assert [[done[f"plain{i}"].outputs[0].token_ids] for i in range(2)] == alone
    assert done["good"].outputs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done["good"].outputs[0].text), SCHEMAS["sentiment"])


def test_bad_constraints_raise_before_anything_is_queued(llm):
    engine = llm.llm_engine
    good = SamplingParams(max_tokens=8)
    cases = [
        ({"regex": "(ab"}, r"(?s)sampling_params\[1\]: structured_outputs.regex: .*unclosed group"),
        (
            {"json": {"type": "array", "uniqueItems": True}},
            r"Unimplemented keys: \[\"uniqueItems\"\]",
        ),
        (
            {"json": {"type": "string", "format": "colour"}},
            "structured_outputs.json: Unknown format",
        ),
        ({"grammar": "start: nothing_here"}, r"(?s)structured_outputs.grammar: .*unknown name"),
    ]
    for so, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate(["a", "b"], [good, SamplingParams(structured_outputs=so)], use_tqdm=False)
        assert not engine.has_unfinished_requests()
        # The engine's own entry (the worker's) refuses the cheap cases synchronously.
        with pytest.raises(ValueError, match="structured_outputs"):
            engine.add_request("x", "a", SamplingParams(structured_outputs=so))
        assert "x" not in engine.parents


def test_a_compile_over_the_limit_fails_that_request_alone(llm):
    engine = llm.llm_engine
    # 3,000 required properties (about 200 KiB): far over a 1 ms limit to compile.
    names = [f"timeout_{i}" for i in range(3000)]
    schema = {
        "type": "object",
        "properties": {n: {"anyOf": [{"type": "string"}, {"type": "null"}]} for n in names},
        "required": names,
    }
    engine.structured.max_compile_s = 0.001
    try:
        slow = SamplingParams(max_tokens=1, structured_outputs={"json": schema})
        engine.add_request("slow", "x", slow)
        engine.add_request(
            "plain", "The sky is", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        )
        done, failed = {}, {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
            failed.update(engine.pop_failed_requests())
    finally:
        engine.structured.max_compile_s = engine.config.max_grammar_compile_s
    assert list(failed) == ["slow"] and "max_grammar_compile_s=0.001" in failed["slow"]
    assert done["plain"].outputs[0].finish_reason == "length"
    # The same grammar now fails at once (the expired compile is remembered).
    with pytest.raises(ValueError, match="max_grammar_compile_s"):
        engine.add_request("again", "x", SamplingParams(structured_outputs={"json": schema}))


def test_forced_tokens_are_counted_and_change_nothing(llm):
    engine = llm.llm_engine
    chats = [chat(PROMPTS[n]) for n in NAMES[:3]]
    params = [json_params(n, temperature=0, logprobs=2) for n in NAMES[:3]]
    before = engine.get_stats()
    with_ff = llm.chat(chats, params, use_tqdm=False)
    stats = engine.get_stats()
    engine.structured.enable_fast_forward = False
    try:
        without = llm.chat(chats, params, use_tqdm=False)
    finally:
        engine.structured.enable_fast_forward = True
    assert token_ids(with_ff) == token_ids(without)
    assert [o.outputs[0].text for o in with_ff] == [o.outputs[0].text for o in without]
    forced = [o.outputs[0].num_forced_tokens for o in with_ff]
    assert all(f > 0 for f in forced) and not any(o.outputs[0].num_forced_tokens for o in without)
    assert stats.num_forced_tokens - before.num_forced_tokens == sum(forced)
    generated = stats.num_generated_tokens - before.num_generated_tokens
    assert stats.num_constrained_tokens - before.num_constrained_tokens == generated - sum(forced)
    # Fewer steps: the forced runs were computed together, as a prefill chunk is.
    c = with_ff[0].outputs[0]
    assert len(c.logprobs) == len(c.token_ids)
    forced_entries = [lp for lp in c.logprobs if lp == {next(iter(lp)): 0.0}]
    assert len(forced_entries) >= c.num_forced_tokens
    assert all(v > float("-inf") for lp in c.logprobs for v in lp.values())


def test_max_tokens_stop_strings_and_min_tokens_with_a_grammar(llm):
    person = chat(PROMPTS["person"])
    cut = llm.chat([person], json_params("person", temperature=0, max_tokens=5), use_tqdm=False)
    assert cut[0].outputs[0].finish_reason == "length" and len(cut[0].outputs[0].token_ids) == 5
    stop = llm.chat([person], json_params("person", temperature=0, stop=['"age"']), use_tqdm=False)
    c = stop[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == '"age"' and c.text.startswith('{"name": ')
    assert '"age"' not in c.text
    # The grammar ends the output even before min_tokens: nothing else may follow it.
    so = StructuredOutputsParams(choice=["yes", "no"])
    outs = llm.chat(
        [chat("Is water wet?")],
        SamplingParams(temperature=0, min_tokens=8, structured_outputs=so),
        use_tqdm=False,
    )
    assert outs[0].outputs[0].text in ("yes", "no")
    assert outs[0].outputs[0].finish_reason == "stop"


def _run_regime(**engine_kwargs):
    engine_kwargs.setdefault("kv_cache_memory", 12 * SMOLLM2_BLOCK_BYTES)
    llm = LLM("smollm2", dtype="float32", **engine_kwargs)
    names = NAMES + NAMES[:1]
    chats = [chat(PROMPTS[n]) for n in names]
    params = [
        json_params(n, max_tokens=40, **({"temperature": 0} if i % 2 else {"seed": i}))
        for i, n in enumerate(names)
    ]
    outs = llm.chat(chats, params, use_tqdm=False)
    return llm.stats, token_ids(outs)


def test_preemption_chunked_prefill_and_prefix_caching_keep_the_tokens():
    stats, roomy = _run_regime(kv_cache_memory="256MiB")
    assert stats.num_preemptions == 0
    stats, got = _run_regime(swap_space=0)
    assert stats.num_preemptions_recompute > 0 and got == roomy
    stats, got = _run_regime(swap_space=0.25)
    assert stats.num_preemptions_swap > 0 and got == roomy
    stats, got = _run_regime(
        kv_cache_memory="256MiB", max_num_batched_tokens=24, enable_prefix_caching=False
    )
    assert stats.num_chunked_prefills > 0 and got == roomy


def test_an_unconstrained_batch_never_builds_a_mask(llm):
    fresh = LLM("smollm2", dtype="float32", kv_cache_memory="64MiB")
    fresh.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert fresh.llm_engine.structured._bitmask is None
    assert fresh.stats.num_grammar_compiles == 0 and fresh.stats.num_constrained_tokens == 0


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing_behind(llm):
    engine = llm.llm_engine
    schema = {"type": "object", "properties": {"aborted_while_compiling": {"type": "integer"}}}
    before = engine.get_stats()
    engine.add_request("gone", "x", SamplingParams(n=2, structured_outputs={"json": schema}))
    assert engine.get_stats().num_waiting_for_grammar == 2
    engine.abort_request("gone")
    assert engine.step() == [] and not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats.num_waiting_for_grammar == 0 and stats.num_running == stats.num_waiting == 0
    # One compile for both samples; asking again hits the cache.
    engine.add_request("again", "x", SamplingParams(structured_outputs={"json": schema}))
    engine.abort_request("again")
    after = engine.get_stats()
    assert after.grammar_cache_hits - before.grammar_cache_hits == 2
    assert after.num_grammar_compiles - before.num_grammar_compiles <= 1
