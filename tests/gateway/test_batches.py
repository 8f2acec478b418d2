"""The Files and Batch APIs over the queue, driven by OpenAI's SDK against real processes."""

from __future__ import annotations

import json
import time

import openai
import pytest
from gw_helpers import batch_file, chat_line, wait_batch

from producer.contract.keys import batch_counts_key, batch_key


def _run_batch(client, lines: list[dict], endpoint: str = "/v1/chat/completions", **kwargs):
    uploaded = client.files.create(file=("in.jsonl", batch_file(lines)), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h", **kwargs
    )


def _lines_of(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_a_batch_runs_to_completion_with_the_answers_the_python_client_gets(oai, stack):
    prompts = [f"Tell me about the number {i}." for i in range(12)]
    lines = [chat_line(f"row-{i}", p, max_tokens=6) for i, p in enumerate(prompts)]
    lines.append(chat_line("bad-body", "x", max_tokens=0))  # a 400 line: the error file
    batch = _run_batch(oai, lines, metadata={"run": "t1"})
    assert batch.status == "validating" and batch.metadata == {"run": "t1"}
    done = wait_batch(oai, batch.id, ("completed", "failed"))
    assert done.status == "completed", done
    assert done.request_counts.total == 13
    assert done.request_counts.completed == 12 and done.request_counts.failed == 1
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    out, errors = _lines_of(oai, done.output_file_id), _lines_of(oai, done.error_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(f"row-{i}" for i in range(12))
    assert [x["custom_id"] for x in errors] == ["bad-body"]
    assert errors[0]["response"]["status_code"] == 400
    assert "max_tokens" in errors[0]["response"]["body"]["error"]["message"]
    with stack.client() as client:
        for row in out:
            i = int(row["custom_id"].split("-")[1])
            job = client.submit(
                messages=[{"role": "user", "content": prompts[i]}], max_tokens=6, temperature=0
            )
            expected = client.result(job, timeout=60)
            body = row["response"]["body"]
            assert row["response"]["status_code"] == 200
            assert body["choices"][0]["message"]["content"] == expected.text
    usage = sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out)
    assert done.usage.output_tokens == usage
    # The files are made from the results: the same bytes on every read, sized as announced.
    output_file = oai.files.retrieve(done.output_file_id)
    content = oai.files.content(done.output_file_id).content
    assert output_file.bytes == len(content) and output_file.purpose == "batch_output"
    assert content == oai.files.content(done.output_file_id).content


def test_a_completions_batch_carries_logprobs(oai):
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "m", "prompt": f"Count {i}", "max_tokens": 3, "logprobs": 1},
        }
        for i in range(3)
    ]
    done = wait_batch(oai, _run_batch(oai, lines, endpoint="/v1/completions").id, ("completed",))
    out = _lines_of(oai, done.output_file_id)
    assert len(out) == 3 and done.error_file_id is None
    assert all(len(x["response"]["body"]["choices"][0]["logprobs"]["tokens"]) == 3 for x in out)


def test_a_file_with_a_line_that_is_not_json_is_refused_at_upload_with_its_line(oai):
    data = batch_file([chat_line("a", "hi")]) + b"{oops\n" + batch_file([chat_line("b", "hi")])
    with pytest.raises(openai.BadRequestError) as err:
        oai.files.create(file=("bad.jsonl", data), purpose="batch")
    assert "line 2" in err.value.body["message"]
    assert err.value.body["code"] == "invalid_file_format"
    with pytest.raises(openai.BadRequestError) as err:
        oai.files.create(file=("x.jsonl", batch_file([chat_line("a", "hi")])), purpose="vision")
    assert err.value.body["param"] == "purpose"


def test_a_file_over_the_limits_is_refused(stack):
    gw = stack.gateway("--max-file-lines", "3", "--max-file-bytes", "2000")
    client = gw.openai()
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(
            file=("many.jsonl", batch_file([chat_line(str(i), "hi") for i in range(4)])),
            purpose="batch",
        )
    assert err.value.body["code"] == "too_many_requests"
    with pytest.raises(openai.APIStatusError) as err:
        client.files.create(file=("big.jsonl", b'{"prompt": "x"}\n' * 300), purpose="batch")
    assert err.value.status_code == 413
    gw.stop()


def test_a_batch_of_a_bad_file_fails_with_line_numbers(oai, stack):
    lines = [
        chat_line("a", "hi"),
        chat_line("a", "again"),
        {**chat_line("c", "hi"), "url": "/v1/completions"},
    ]
    done = wait_batch(oai, _run_batch(oai, lines).id, ("failed", "completed"))
    assert done.status == "failed" and done.failed_at
    errors = [(e.code, e.line) for e in done.errors.data]
    assert errors == [("duplicate_custom_id", 2), ("mismatched_endpoint", 3)]
    assert not stack.redis.exists(batch_counts_key(done.id)) or done.request_counts.completed == 0


def test_cancel_mid_batch_keeps_partial_output_and_exact_counts(oai, stack):
    short = [chat_line(f"s{i}", f"Say {i}", max_tokens=2) for i in range(5)]
    long = [chat_line(f"l{i}", f"Say {i}", max_tokens=400, ignore_eos=True) for i in range(35)]
    batch = _run_batch(oai, short + long)
    deadline = time.monotonic() + 120
    while oai.batches.retrieve(batch.id).request_counts.completed < 5:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # Frozen, the worker cannot end its running lines: the batch waits in `cancelling`.
    with stack.worker.paused():
        cancelling = oai.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at
        time.sleep(1.0)
        assert oai.batches.retrieve(batch.id).status == "cancelling"
    done = wait_batch(oai, batch.id, ("cancelled",))
    counts = done.request_counts
    out, errors = _lines_of(oai, done.output_file_id), _lines_of(oai, done.error_file_id)
    assert (counts.total, counts.completed, counts.failed) == (40, 5, 35)
    assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in short)
    assert sorted(x["custom_id"] for x in errors) == sorted(x["custom_id"] for x in long)
    assert {x["error"]["code"] for x in errors} == {"batch_cancelled"}
    assert done.cancelled_at >= done.cancelling_at
    assert stack.redis.hget(batch_counts_key(batch.id), "canceled") == b"35"
    with pytest.raises(openai.ConflictError):
        oai.batches.cancel(wait_batch(oai, _run_batch(oai, short[:1]).id, ("completed",)).id)


def test_a_gateway_killed_mid_batch_changes_nothing(stack):
    first = stack.gateway("--batch-lease-seconds", "2")
    client = first.openai()
    lines = [chat_line(f"k{i}", f"Word {i}", max_tokens=8) for i in range(40)]
    batch = _run_batch(client, lines)
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).request_counts.completed < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    first.kill()
    second = stack.gateway("--batch-lease-seconds", "2")
    done = wait_batch(second.openai(), batch.id, ("completed",))
    assert (done.request_counts.completed, done.request_counts.failed) == (40, 0)
    out = _lines_of(second.openai(), done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(f"k{i}" for i in range(40))
    # Every line ran once: its job ended once, in one execution.
    job_ids = {x["response"]["request_id"] for x in out}
    assert len(job_ids) == 40
    assert all(stack.redis.xlen(f"rq:results:{j}") == 1 for j in job_ids)
    second.stop()


def test_two_gateways_report_the_same_batch(oai, stack, gateway):
    other = stack.gateway()
    batch = _run_batch(oai, [chat_line(f"t{i}", "hello", max_tokens=4) for i in range(5)])
    done = wait_batch(other.openai(), batch.id, ("completed",))
    assert oai.batches.retrieve(batch.id) == other.openai().batches.retrieve(batch.id)
    assert done.request_counts.completed == 5
    assert other.openai().files.content(done.output_file_id).content == (
        oai.files.content(done.output_file_id).content
    )
    ids = [b.id for b in other.openai().batches.list(limit=100)]
    assert batch.id in ids
    other.stop()


def test_files_list_retrieve_delete_and_tenants_are_apart(oai, gateway):
    data = batch_file([chat_line("a", "hi")])
    uploaded = oai.files.create(file=("mine.jsonl", data), purpose="batch")
    assert uploaded.bytes == len(data) and uploaded.filename == "mine.jsonl"
    assert oai.files.retrieve(uploaded.id).id == uploaded.id
    assert oai.files.content(uploaded.id).content == data
    assert uploaded.id in [f.id for f in oai.files.list()]
    other = gateway.openai(key="sk-team-b")
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(uploaded.id)
    assert uploaded.id not in [f.id for f in other.files.list()]
    assert oai.files.delete(uploaded.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        oai.files.retrieve(uploaded.id)


def test_batches_list_pages_with_after_and_limit(oai):
    ids = [_run_batch(oai, [chat_line("p", "hi", max_tokens=2)]).id for _ in range(3)]
    page = oai.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    rest = oai.batches.list(limit=2, after=page.data[-1].id)
    assert rest.data[0].id == ids[0]
    for batch_id in ids:
        wait_batch(oai, batch_id, ("completed",))


def test_a_gateway_killed_while_enqueueing_is_resumed_by_another(stack):
    # One line per stored chunk, so the kill lands between two chunks' commits.
    options = ("--batch-lease-seconds", "2", "--file-chunk-bytes", "200")
    first = stack.gateway(*options)
    client = first.openai()
    lines = [chat_line(f"e{i}", f"Item {i}", max_tokens=3) for i in range(80)]
    batch = _run_batch(client, lines)
    deadline = time.monotonic() + 60
    while int(stack.redis.hget(batch_key(batch.id), "next_chunk") or 0) < 5:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    first.kill()
    next_chunk = int(stack.redis.hget(batch_key(batch.id), "next_chunk"))
    assert next_chunk < 80, "the gateway enqueued everything before it was killed"
    second = stack.gateway(*options)
    done = wait_batch(second.openai(), batch.id, ("completed",))
    assert (done.request_counts.completed, done.request_counts.failed) == (80, 0)
    out = _lines_of(second.openai(), done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(f"e{i}" for i in range(80))
    job_ids = {x["response"]["request_id"] for x in out}
    assert len(job_ids) == 80
    assert all(stack.redis.xlen(f"rq:results:{j}") == 1 for j in job_ids)
    second.stop()
