"""Chat and completions over HTTP, driven by OpenAI's SDK: same answers as the Python client."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from producer.contract.keys import JOB_FIELDS, result_key, rq_job_key, stream_key, wake_key
from producer.contract.stream import RESULT_FIELD, inline_entries, is_inline

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_lists_the_model_the_live_worker_serves(oai, stack):
    models = [m.id for m in oai.models.list()]
    assert models == [stack.worker.status()["model"]]
    assert oai.models.retrieve(models[0]).id == models[0]


def test_a_chat_completion_is_what_the_python_client_gets_for_the_same_request(oai, stack):
    answer = oai.chat.completions.create(
        model="gpt-4o-mini", messages=MESSAGES, max_tokens=8, temperature=0
    )
    with stack.client() as client:
        job = client.submit(messages=MESSAGES, max_tokens=8, temperature=0)
        expected = client.result(job, timeout=60)
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == expected.text
    assert answer.choices[0].finish_reason == expected.finish_reason
    assert answer.usage.completion_tokens == expected.usage.completion_tokens
    assert answer.usage.prompt_tokens == expected.usage.prompt_tokens
    # A whole answer streams no tokens, but its end is told to the gateway's hub at once.
    job_id = answer.id.removeprefix("chatcmpl-")
    entries = _inline_entries(stack, job_id)
    assert [e["event"] for e in entries] == ["done"]
    # ... and its result is in its result key, where the hub reads it: not in the wake entry.
    assert RESULT_FIELD not in entries[0] and stack.redis.exists(result_key(job_id))


def _inline_entries(stack, job_id: str) -> list[dict[str, str]]:
    """The entries a job got in its gateway's inline wake stream (none in its own stream)."""
    assert stack.redis.xlen(stream_key(job_id)) == 0
    wake = stack.redis.hget(rq_job_key(job_id), JOB_FIELDS["wake"]).decode()
    assert is_inline(wake)
    return [
        e for _, f in stack.redis.xrange(wake_key(wake)) for e in inline_entries(f).get(job_id, [])
    ]


def test_streamed_chat_deltas_join_to_the_non_streamed_text(oai):
    # A long answer: its tokens span several of the hub's reads (50 ms apart) even where the
    # tiny model samples a token a millisecond.
    messages = [{"role": "user", "content": "Tell me a long story about a dragon."}]
    whole = oai.chat.completions.create(
        model="any", messages=messages, max_tokens=256, temperature=0
    )
    stream = oai.chat.completions.create(
        model="any",
        messages=messages,
        max_tokens=256,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert [f for f in finishes if f] == [finishes[-1]]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) > 1


def test_every_streamed_job_reads_the_same_text_over_sse_and_client_stream(oai, stack):
    """Several jobs at once, their tokens written in shared windows: the SSE text and the
    Python client's stream of each job are its whole result, token for token (the client's
    stream of a gateway job, whose tokens go to the gateway's hub, comes at its end)."""
    sse_texts: dict[str, str] = {}
    live: dict[str, str] = {}

    def request(i: int) -> None:
        chunks = oai.completions.create(
            model="any", prompt=f"Item {i}:", max_tokens=24, temperature=0.9, seed=i, stream=True
        )
        job_id, parts = None, []
        for chunk in chunks:
            if job_id is None:
                job_id = chunk.id.removeprefix("cmpl-")
                reader = threading.Thread(target=read_live, args=(job_id,))
                reader.start()
            parts += [c.text for c in chunk.choices]
        sse_texts[job_id] = "".join(parts)
        reader.join()

    def read_live(job_id: str) -> None:
        with stack.client() as client:
            live[job_id] = "".join(client.stream(job_id, timeout=120))

    threads = [threading.Thread(target=request, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(sse_texts) == len(live) == 6
    with stack.client() as client:
        for job_id, text in sse_texts.items():
            result = client.result(job_id, timeout=30)
            assert text == live[job_id] == result.text
            # The tokens went inline to the gateway's wake stream, not to the job's stream.
            entries = _inline_entries(stack, job_id)
            assert entries[-1]["event"] == "done" and RESULT_FIELD not in entries[-1]
            # ... as their text alone (the hub's wake id takes deltas): no token ids.
            tokens = [e for e in entries if e["event"] == "token"]
            assert "".join(e["delta"] for e in tokens) == result.text
            assert not any("token_ids" in e for e in tokens)


def test_completions_whole_and_streamed_with_n_and_logprobs(oai):
    whole = oai.completions.create(
        model="any", prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2
    )
    assert whole.object == "text_completion"
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == whole.usage.completion_tokens == len(lp.token_logprobs)
    streamed = oai.completions.create(
        model="any", prompt="The capital of France is", max_tokens=6, temperature=0, stream=True
    )
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert text == whole.choices[0].text
    many = oai.chat.completions.create(
        model="any", messages=MESSAGES, max_tokens=4, n=3, temperature=1.0, seed=7
    )
    assert [c.index for c in many.choices] == [0, 1, 2]
    streamed = oai.chat.completions.create(
        model="any", messages=MESSAGES, max_tokens=4, n=3, temperature=1.0, seed=7, stream=True
    )
    texts = {0: "", 1: "", 2: ""}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {c.index: c.message.content for c in many.choices}


def test_chat_logprobs_come_as_openai_shapes(oai):
    answer = oai.chat.completions.create(
        model="any", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in content)


def test_a_bad_field_is_a_400_naming_it(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="any", messages=MESSAGES, max_tokens=0)
    assert err.value.status_code == 400
    assert err.value.body["param"] == "max_tokens"
    assert err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="any", messages=MESSAGES, temperature="hot")
    assert err.value.body["param"] == "temperature"


def test_validation_errors_of_fastapi_use_openais_envelope(gateway):
    r = httpx.get(gateway.url + "/v1/files?limit=0", headers={"Authorization": "Bearer sk-team-a"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "limit"
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(
        gateway.url + "/v1/chat/completions",
        content=b"{not json",
        headers={"Authorization": "Bearer sk-team-a"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.get(gateway.url + "/v1/nothing", headers={"Authorization": "Bearer sk-team-a"})
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_no_key_and_a_wrong_key_are_401(gateway):
    with pytest.raises(openai.AuthenticationError) as err:
        gateway.openai(key="sk-wrong").models.list()
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    r = httpx.get(gateway.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
    assert "sk-wrong" not in gateway.log_tail(100_000)


def test_a_client_that_disconnects_cancels_its_job(gateway, stack):
    body = {
        "model": "any",
        "messages": MESSAGES,
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": "Bearer sk-team-a"}
    with httpx.stream(
        "POST", gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as r:
        lines = r.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data:"))[5:])
        job_id = first["id"].removeprefix("chatcmpl-")
        # Wait for real tokens, then hang up mid-stream.
        next(line for line in lines if '"content":"' in line and '"content":""' not in line)
    deadline = time.monotonic() + 30
    with stack.client() as client:
        while client.status(job_id) != "canceled":
            assert time.monotonic() < deadline, client.status(job_id)
            time.sleep(0.1)
        result = json.loads(stack.redis.get(f"pagedq:result:{job_id}"))
    assert result["status"] == "canceled"
    assert len(result["token_ids"]) < 400


def test_a_request_naming_the_served_model_goes_to_its_queue(oai, stack):
    served = oai.models.list().data[0].id
    answer = oai.chat.completions.create(model=served, messages=MESSAGES, max_tokens=2)
    job_id = answer.id.removeprefix("chatcmpl-")
    assert stack.redis.hget(f"rq:job:{job_id}", "origin").decode().startswith("gw@")
    assert answer.model == served
    other = oai.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, max_tokens=2)
    origin = stack.redis.hget(f"rq:job:{other.id.removeprefix('chatcmpl-')}", "origin")
    assert origin == b"gw:t:team-a"  # the shared queue (the key's tenant's sub-queue)
