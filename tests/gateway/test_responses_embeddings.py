"""/v1/responses and /v1/embeddings through OpenAI's own SDK, against a real gateway and a real
worker (fp32, so that embeddings can be held to Hugging Face within 1e-5), plus batch files
mixing chat, responses and embeddings lines."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Iterator

import jsonschema
import numpy as np
import openai
import pytest
import torch
from gw_helpers import QUEUE, REPO, GatewayProcess, batch_file, chat_line, wait_batch
from openai import OpenAI
from redis import Redis
from worker_process import WorkerProcess

from producer.contract.keys import response_key
from worker.redis_server import PrivateRedis

MODEL = "tiny"
TEXTS = ["The capital of France is", "Paris is a city in"]


@pytest.fixture(scope="module")
def served(tiny_llama_dir: str, tmp_path_factory) -> Iterator[tuple[GatewayProcess, str]]:
    """Redis, one fp32 worker of the tiny model and one gateway (no keys), for this module."""
    log_dir = tmp_path_factory.mktemp("responses-logs")
    with PrivateRedis() as server:
        worker = WorkerProcess(
            server.url,
            QUEUE,
            "responses-tests",
            log_dir,
            "--dtype",
            "float32",
            model=tiny_llama_dir,
            kv_cache_memory="16MiB",
            env={"OMP_NUM_THREADS": "1"},
        )
        gateway = None
        try:
            worker.wait_ready(timeout=120)
            gateway = GatewayProcess(server.url, log_dir, None)
            yield gateway, server.url
        finally:
            if gateway is not None:
                gateway.stop()
            worker.stop(timeout=15)


@pytest.fixture(scope="module")
def oai(served) -> OpenAI:
    return served[0].openai()


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: str):
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_llama_dir)


def hf_last_token(hf, ids: list[int], dimensions: int | None = None) -> np.ndarray:
    """Hugging Face's last_hidden_state (final norm applied) at the last token, normalised."""
    with torch.no_grad():
        state = hf[0](torch.tensor([ids])).last_hidden_state[0, -1]
    if dimensions is not None:
        state = state[:dimensions]
    return torch.nn.functional.normalize(state, dim=-1).numpy()


# --- responses ------------------------------------------------------------------------------------


def test_response_whole_equals_chat(oai: OpenAI) -> None:
    """A response is the chat completion of instructions + input (greedy: the same text)."""
    resp = oai.responses.create(
        model=MODEL,
        input="What is the capital of France?",
        instructions="Answer briefly.",
        max_output_tokens=6,
        temperature=0,
    )
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        max_tokens=6,
        temperature=0,
    )
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.output[0].type == "message"
    assert resp.output_text == chat.choices[0].message.content
    assert resp.status == (
        "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    )
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert oai.responses.retrieve(resp.id).output_text == resp.output_text


def test_response_stream_events(oai: OpenAI) -> None:
    whole = oai.responses.create(model=MODEL, input="Hi there", max_output_tokens=8, temperature=0)
    events = list(
        oai.responses.create(
            model=MODEL, input="Hi there", max_output_tokens=8, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    end = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        end,
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert "".join(deltas) == final.output_text == events[-4].text == whole.output_text
    assert oai.responses.retrieve(final.id).output_text == final.output_text


def test_response_json_schema(oai: OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
    }
    resp = oai.responses.create(
        model=MODEL,
        input="Is Paris in France?",
        text={
            "format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}
        },
        max_output_tokens=40,
        temperature=0,
    )
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), schema)
    assert resp.text.format.type == "json_schema"


def test_forced_function_call_and_its_output(oai: OpenAI) -> None:
    parameters = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "name": "get_weather", "parameters": parameters}]
    resp = oai.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=30,
        temperature=0,
    )
    call = resp.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), parameters)
    follow = oai.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
        tools=tools,
        max_output_tokens=4,
        temperature=0,
    )  # fmt: skip
    assert follow.output[0].type == "message"
    events = list(
        oai.responses.create(
            model=MODEL,
            input="Weather in Paris?",
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,  # one call: a random model would go on calling
            max_output_tokens=30,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = events[-1].response.output[0]
    assert done.type == "function_call" and events[3].delta == done.arguments
    jsonschema.validate(json.loads(done.arguments), parameters)


def test_previous_response_id_continues(oai: OpenAI, served, hf) -> None:
    first = oai.responses.create(model=MODEL, input="Say hi", max_output_tokens=4, temperature=0)
    second = oai.responses.create(
        model=MODEL,
        input="Again",
        previous_response_id=first.id,
        max_output_tokens=4,
        temperature=0,
    )
    turns = [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Again"},
    ]
    rendered = hf[1].apply_chat_template(
        turns, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert second.usage.input_tokens == len(rendered)
    stored = json.loads(Redis.from_url(served[1]).get(response_key(second.id)))
    assert stored["messages"][:3] == turns
    assert second.previous_response_id == first.id


def test_missing_previous_response_id_is_400(oai: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    assert err.value.body["param"] == "tools[0].type"
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve("resp_nope")


# --- embeddings -----------------------------------------------------------------------------------


def test_embeddings_float_and_base64_match_hf(oai: OpenAI, hf) -> None:
    floats = oai.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    packed = oai.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64
    assert [d.index for d in floats.data] == [0, 1]
    ids = [hf[1].encode(t) for t in TEXTS]
    assert floats.usage.prompt_tokens == sum(map(len, ids))
    for text_ids, f, p in zip(ids, floats.data, packed.data):
        expected = hf_last_token(hf, text_ids)
        np.testing.assert_allclose(np.array(f.embedding), expected, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(
            np.array(p.embedding, dtype=np.float32), np.float32(f.embedding)
        )


def test_embeddings_token_ids_and_dimensions(oai: OpenAI, served, hf) -> None:
    ids = hf[1].encode(TEXTS[0])
    one = oai.embeddings.create(model=MODEL, input=ids, encoding_format="float", dimensions=16)
    many = oai.embeddings.create(model=MODEL, input=[ids, ids[:3]], encoding_format="float")
    assert len(one.data) == 1 and len(one.data[0].embedding) == 16
    np.testing.assert_allclose(one.data[0].embedding, hf_last_token(hf, ids, 16), atol=1e-5, rtol=0)
    np.testing.assert_allclose(
        many.data[1].embedding, hf_last_token(hf, ids[:3]), atol=1e-5, rtol=0
    )
    with pytest.raises(openai.BadRequestError) as err:
        oai.embeddings.create(model=MODEL, input="x", dimensions=65)
    assert err.value.body["param"] == "dimensions" and "hidden size 64" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        oai.embeddings.create(model=MODEL, input="x", extra_body={"truncate_prompt_tokens": 3})
    assert err.value.body["param"] == "truncate_prompt_tokens"
    raw = (
        served[0]
        .openai()
        .embeddings.with_raw_response.create(model=MODEL, input="x", encoding_format="base64")
    )
    vector = np.frombuffer(base64.b64decode(json.loads(raw.text)["data"][0]["embedding"]), "<f4")
    assert vector.shape == (64,) and abs(float(np.linalg.norm(vector)) - 1) < 1e-5


# --- batch files ----------------------------------------------------------------------------------


def _responses_line(custom_id: str, text: str) -> dict:
    body = {"model": MODEL, "input": text, "max_output_tokens": 5, "temperature": 0}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses", "body": body}


def _embeddings_line(custom_id: str, inputs) -> dict:
    body = {"model": MODEL, "input": inputs, "encoding_format": "base64"}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}


def test_mixed_batch_file_with_pagedq_submit(served, tmp_path, hf) -> None:
    """`pagedq submit` on one file of chat, responses and embeddings lines: every line answered
    with its endpoint's body, one bad line a 400."""
    lines = [
        chat_line("chat-0", "Hello", max_tokens=4),
        _responses_line("resp-0", "Hello"),
        _embeddings_line("emb-0", TEXTS),
        chat_line("chat-1", "Bye", max_tokens=4),
        _embeddings_line("emb-bad", []),
        _responses_line("resp-1", "Bye"),
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(batch_file(lines))
    done = subprocess.run(
        [sys.executable, "-m", "producer.cli", "submit", str(src), "-o", str(out),
         "--redis-url", served[1], "--queue", QUEUE, "--no-progress"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr  # one line failed
    answers = {a["custom_id"]: a for a in map(json.loads, out.read_text().splitlines())}
    assert sorted(answers) == sorted(line["custom_id"] for line in lines)
    codes = {cid: a["response"]["status_code"] for cid, a in answers.items()}
    assert codes == {**dict.fromkeys(codes, 200), "emb-bad": 400}
    assert answers["emb-bad"]["response"]["body"]["error"]["message"].find("input") >= 0
    assert answers["chat-0"]["response"]["body"]["object"] == "chat.completion"
    resp = answers["resp-0"]["response"]["body"]
    assert resp["object"] == "response" and resp["output"][0]["type"] == "message"
    emb = answers["emb-0"]["response"]["body"]
    vectors = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in emb["data"]]
    for text, vector in zip(TEXTS, vectors):
        np.testing.assert_allclose(vector, hf_last_token(hf, hf[1].encode(text)), atol=1e-5)


@pytest.mark.parametrize(
    "endpoint,make",
    [("/v1/responses", _responses_line), ("/v1/embeddings", _embeddings_line)],
)
def test_batches_api_responses_and_embeddings(oai: OpenAI, endpoint: str, make) -> None:
    lines = [make(f"r{i}", TEXTS[i]) for i in range(2)]
    uploaded = oai.files.create(file=("in.jsonl", batch_file(lines)), purpose="batch")
    batch = oai.batches.create(
        input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h"
    )
    done = wait_batch(oai, batch.id, ("completed", "failed"))
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 0)
    out = [json.loads(x) for x in oai.files.content(done.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == ["r0", "r1"]
    bodies = [o["response"]["body"] for o in out]
    if endpoint == "/v1/responses":
        assert all(b["object"] == "response" and b["output"] for b in bodies)
    else:
        assert all(b["object"] == "list" and len(b["data"]) == 1 for b in bodies)


def test_the_documented_example_runs(served, tmp_path, monkeypatch) -> None:
    """docs/GATEWAY.md's responses and embeddings example, as written (only the URL swapped)."""
    import contextlib
    import io
    import re

    doc = (REPO / "docs" / "GATEWAY.md").read_text()
    pattern = r"<!-- gateway-example: responses -->\s*```python\n(.*?)```"
    code = re.findall(pattern, doc, re.S)[0].replace(
        "http://localhost:8000/v1", served[0].url + "/v1"
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "GATEWAY.md:responses", "exec"), {})
    assert out.getvalue().splitlines()[-1].split()[:2] == ["2", "64"]
