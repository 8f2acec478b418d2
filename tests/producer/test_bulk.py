"""`pagedq submit`: OpenAI batch lines in, OpenAI batch output out, resumable, nothing twice."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from producer.bulk import (
    BadInputFileError,
    BulkRun,
    StaleOutputError,
    count_lines,
    load_done,
    run_bulk,
)
from producer.openai_batch import CHAT_URL, COMPLETIONS_URL, FileFormatError, parse_line
from producer.openai_output import BatchOutputLine


def openai_line(custom_id: str, content: str, **body) -> str:
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}], **body}
    line = {"custom_id": custom_id, "method": "POST", "url": CHAT_URL, "body": body}
    return json.dumps(line)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# Random weights: fix each answer's length (ignore_eos) and make it greedy.
FIXED = {"max_tokens": 4, "ignore_eos": True, "temperature": 0}


@pytest.fixture
def client(served):
    served.wait_idle()  # nothing left over from an earlier test runs meanwhile
    with served.client() as c:
        yield c


def job_id_of(row: dict) -> str:
    return row["id"].removeprefix("batch_req_")


def test_parse_openai_chat_line_maps_body_fields():
    raw = openai_line(
        "a", "hi", max_completion_tokens=7, temperature=0, logprobs=True, top_logprobs=3, user="u1"
    )
    parsed = parse_line(raw, 1)
    assert (parsed.custom_id, parsed.url, parsed.error) == ("a", CHAT_URL, None)
    request = parsed.request
    assert (request.max_tokens, request.temperature, request.logprobs) == (7, 0.0, 3)
    assert request.model is None and request.custom_id == "a"
    assert request.messages[0].content == "hi"


def test_parse_completion_and_plain_lines():
    raw = json.dumps({"custom_id": "c", "url": COMPLETIONS_URL, "body": {"prompt": "x", "n": 2}})
    assert parse_line(raw, 1).request.n == 2 and parse_line(raw, 1).url == COMPLETIONS_URL
    plain = parse_line('{"prompt": "hello", "max_tokens": 3}', 12, model="smollm2")
    assert (plain.custom_id, plain.url, plain.request.model) == (
        "line-12",
        COMPLETIONS_URL,
        "smollm2",
    )
    chat = parse_line('{"messages": [{"role": "user", "content": "x"}], "custom_id": "k"}', 2)
    assert (chat.custom_id, chat.url) == ("k", CHAT_URL)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("{not json", "line 3: invalid JSON"),
        ("[1, 2]", "line 3: not a JSON object"),
        ('{"custom_id": 5, "prompt": "x"}', "custom_id must be a non-empty str"),
        ('{"method": "POST", "url": "/v1/completions", "body": {}}', "custom_id is required"),
        ('{"custom_id": "b", "url": "/v1/moderations", "body": {}}', "url must be"),
        ('{"custom_id": "b", "method": "GET", "body": {"prompt": "x"}}', "method must be"),
        ('{"custom_id": "b", "body": [1]}', "body must be a JSON object"),
        ('{"custom_id": "b", "body": {}, "extra": 1}', "unknown top-level field(s) ['extra']"),
    ],
)
def test_lines_openai_would_refuse_at_upload_raise(raw, message):
    with pytest.raises(FileFormatError, match=re.escape(message)):
        parse_line(raw, 3)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (openai_line("b", "x", max_tokens=0), "max_tokens: must be >= 1, got 0"),
        (openai_line("b", "x", tools=[]), "tools: unknown field"),
        (openai_line("b", "x", max_tokens=3, max_completion_tokens=3), "not both"),
    ],
)
def test_bad_bodies_become_error_lines_not_exceptions(raw, message):
    parsed = parse_line(raw, 3)
    assert parsed.request is None and parsed.custom_id == "b"
    assert message in parsed.error


def test_load_done_cuts_a_torn_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"custom_id": "a"}\n{"custom_id": "b"}\n{"custom_id": "c", "resp')
    assert load_done(str(out)) == {"a", "b"}
    assert out.read_text() == '{"custom_id": "a"}\n{"custom_id": "b"}\n'
    assert count_lines(str(out)) == 2
    out.write_text("x\ny")
    assert count_lines(str(out)) == 2


def test_bulk_writes_one_openai_output_line_per_input_line(served, client, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    counts_before = served.job_counts()
    lines = [openai_line(f"req-{i}", f"q{i}", **FIXED) for i in range(5)]
    lines += [
        json.dumps({"prompt": "plain", **FIXED}),
        "",
        openai_line("bad", "x", top_p=7),
        openai_line("fails", "word " * 600),  # longer than the worker's max_model_len
        openai_line("chat-lp", "lp", logprobs=True, top_logprobs=2, **FIXED),
        json.dumps(
            {
                "custom_id": "cmpl-lp",
                "url": COMPLETIONS_URL,
                "body": {"prompt": "z", "logprobs": 3, **FIXED},
            }
        ),
    ]
    src.write_text("\n".join(lines) + "\n")
    summary = run_bulk(client, str(src), str(out), progress=False, chunk_size=3, window=4)
    raw_rows = read_jsonl(out)
    rows = {row["custom_id"]: row for row in raw_rows}
    assert len(raw_rows) == len(rows) == 10  # one line per non-blank input line
    for row in raw_rows:  # every line is the typed OpenAI shape, nothing more
        assert BatchOutputLine.model_validate(row).model_dump(mode="json") == row
    assert (summary.finished, summary.failed, summary.invalid) == (8, 1, 1)
    assert summary.reused == 0 and summary.completion_tokens == 8 * 4

    ok = rows["req-2"]
    assert ok["error"] is None and ok["id"].startswith("batch_req_pq-")
    result = client.result(job_id_of(ok))  # what the worker wrote
    body = ok["response"]["body"]
    assert ok["response"]["status_code"] == 200 and body["object"] == "chat.completion"
    assert body["id"] == f"chatcmpl-{result.job_id}" and isinstance(body["created"], int)
    assert body["model"] == served.model
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": result.text, "refusal": None}
    assert len(result.token_ids) == 4
    assert (choice["finish_reason"], choice["logprobs"]) == ("length", None)
    prompt_tokens = result.usage.prompt_tokens
    assert prompt_tokens > 2  # the chat template around "q2"
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 4,
        "total_tokens": prompt_tokens + 4,
    }
    assert ok["response"]["request_id"] == job_id_of(ok)

    plain = rows["line-6"]["response"]["body"]
    assert plain["object"] == "text_completion"
    assert plain["choices"][0]["text"] == client.result(job_id_of(rows["line-6"])).text
    bad = rows["bad"]
    assert bad["error"] is None and bad["response"]["status_code"] == 400
    error = bad["response"]["body"]["error"]
    assert error["type"] == "invalid_request_error"
    assert "top_p: must be in (0, 1], got 7" in error["message"]
    fails = rows["fails"]
    assert fails["error"] is None and fails["response"]["status_code"] == 500
    assert fails["response"]["body"]["error"]["code"] == "job_failed"
    assert "must be shorter than max_model_len" in fails["response"]["body"]["error"]["message"]

    # Chat logprobs: content[] per token, the sampled token's logprob, the 2 likeliest.
    lp_result = client.result(job_id_of(rows["chat-lp"]))
    content = rows["chat-lp"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for token_id, entry, candidates in zip(lp_result.token_ids, content, lp_result.logprobs):
        assert entry["logprob"] == candidates[token_id]
        best = sorted(candidates.values(), reverse=True)[:2]
        assert [t["logprob"] for t in entry["top_logprobs"]] == best
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
    # Completions logprobs: parallel lists, one entry per generated token.
    c_result = client.result(job_id_of(rows["cmpl-lp"]))
    c_lp = rows["cmpl-lp"]["response"]["body"]["choices"][0]["logprobs"]
    assert set(c_lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert c_lp["token_logprobs"] == [d[t] for t, d in zip(c_result.token_ids, c_result.logprobs)]
    assert len(c_lp["tokens"]) == len(c_lp["text_offset"]) == len(c_lp["top_logprobs"]) == 4
    assert all(3 <= len(top) <= 4 for top in c_lp["top_logprobs"])

    # Each of the 9 jobs ran once: 8 finished and 1 failed execution, nothing more.
    jobs = [job_id_of(r) for r in rows.values() if r["custom_id"] != "bad"]
    assert len(jobs) == 9 and [served.executions(j) for j in jobs] == [1] * 9
    served.wait_idle()
    successful, failed = served.job_counts()
    assert (successful - counts_before[0], failed - counts_before[1]) == (8, 1)


def test_a_file_openai_would_refuse_queues_nothing(redis_server, redis_client, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [openai_line(f"r{i}", "x") for i in range(3)]
    lines += [
        "{broken",
        openai_line("r1", "again"),
        '{"custom_id": "m", "method": "PUT", "body": {}}',
    ]
    src.write_text("\n".join(lines) + "\n")
    from producer.client import Client

    with Client(redis_server.url) as client, pytest.raises(BadInputFileError) as caught:
        run_bulk(client, str(src), str(out), progress=False)
    message = str(caught.value)
    assert "3 bad line(s), nothing was queued" in message
    assert "line 4: invalid JSON" in message
    assert "line 5: duplicate custom_id 'r1' (first on line 2)" in message
    assert "line 6: method must be POST" in message
    assert redis_client.llen("rq:queue:pagedq") == 0 and not out.exists()


def test_an_edited_line_is_recomputed_and_the_others_reused(served, client, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(openai_line(f"e{i}", f"q{i}", **FIXED) + "\n" for i in range(4)))
    run_bulk(client, str(src), str(out), progress=False)
    before = {r["custom_id"]: r for r in read_jsonl(out)}
    src.write_text(
        "".join(
            openai_line(f"e{i}", "edited" if i == 2 else f"q{i}", **FIXED) + "\n" for i in range(4)
        )
    )
    summary = run_bulk(client, str(src), str(out), progress=False)
    after = read_jsonl(out)
    assert sorted(r["custom_id"] for r in after) == ["e0", "e1", "e2", "e3"]
    assert (summary.skipped, summary.submitted, summary.finished) == (3, 1, 1)
    rows = {r["custom_id"]: r for r in after}
    assert all(rows[c] == before[c] for c in ("e0", "e1", "e3"))
    assert job_id_of(rows["e2"]) != job_id_of(before["e2"])
    assert served.fetch(job_id_of(rows["e2"])).args[0]["messages"][0]["content"] == "edited"
    assert served.executions(job_id_of(rows["e2"])) == 1

    # OUT of another file is refused, not overwritten.
    other = tmp_path / "other.jsonl"
    other.write_text(openai_line("zz", "x", **FIXED) + "\n")
    with pytest.raises(StaleOutputError, match="custom_id is not in the input"):
        run_bulk(client, str(other), str(out), progress=False)


def test_a_rerun_into_a_new_output_reuses_results_and_counts_no_tokens(served, client, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(openai_line(f"t{i}", f"q{i}", **FIXED) + "\n" for i in range(3)))
    first = run_bulk(client, str(src), str(tmp_path / "a.jsonl"), progress=False)
    assert (first.finished, first.reused, first.completion_tokens) == (3, 0, 12)
    again = run_bulk(client, str(src), str(tmp_path / "b.jsonl"), progress=False)
    assert (again.finished, again.reused, again.completion_tokens) == (3, 3, 0)
    a, b = read_jsonl(tmp_path / "a.jsonl"), read_jsonl(tmp_path / "b.jsonl")
    assert sorted(r["id"] for r in a) == sorted(r["id"] for r in b)


def test_rerun_skips_done_lines_and_reuses_jobs_without_computing_twice(served, client, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(openai_line(f"r{i}", f"q{i}", **FIXED) + "\n" for i in range(30)))
    counts_before = served.job_counts()

    class Interrupted(BulkRun):
        written = 0

        def _write(self, line):
            if self.written == 8:
                raise KeyboardInterrupt
            self.written += 1
            super()._write(line)

    with pytest.raises(KeyboardInterrupt):
        Interrupted(client, str(src), str(out), progress=False, window=12, chunk_size=4).run()
    first = read_jsonl(out)
    assert len(first) == 8
    time.sleep(0.3)  # the worker goes on with what was queued meanwhile

    summary = run_bulk(client, str(src), str(out), progress=False, window=12, chunk_size=4)
    rows = read_jsonl(out)
    assert sorted(r["custom_id"] for r in rows) == sorted(f"r{i}" for i in range(30))
    assert summary.skipped == len(first)
    assert all(r["error"] is None for r in rows)
    jobs = {job_id_of(r) for r in rows}
    assert len(jobs) == 30 and all(served.executions(j) == 1 for j in jobs)
    served.wait_idle()
    assert served.job_counts()[0] - counts_before[0] == 30


def test_two_files_with_the_same_custom_ids_are_different_jobs(served, client, tmp_path):
    rows = {}
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"prompt": name, **FIXED}) + "\n")
        run_bulk(
            client, str(tmp_path / f"{name}.jsonl"), str(tmp_path / f"{name}.out"), progress=False
        )
        [rows[name]] = read_jsonl(tmp_path / f"{name}.out")
    assert rows["a"]["custom_id"] == rows["b"]["custom_id"] == "line-1"
    assert job_id_of(rows["a"]) != job_id_of(rows["b"])
    for row in rows.values():
        result = client.result(job_id_of(row))
        assert row["response"]["body"]["choices"][0]["text"] == result.text
        assert served.executions(result.job_id) == 1


def test_cli_submit_killed_halfway_then_rerun_loses_no_line(served, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    n = 60
    served.wait_idle()
    counts_before = served.job_counts()
    # Answers of different lengths end at different times: OUT grows line by line.
    src.write_text(
        "".join(
            json.dumps({"prompt": f"p{i}", "max_tokens": 24 + 8 * (i % 5), "ignore_eos": True})
            + "\n"
            for i in range(n)
        )
    )
    cmd = [
        sys.executable,
        "-m",
        "producer.cli",
        "submit",
        str(src),
        "-o",
        str(out),
        "--redis-url",
        served.url,
        "--queue",
        served.queue,
        "--no-progress",
        "--window",
        "8",
        "--chunk-size",
        "4",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while (not out.exists() or len(out.read_text().splitlines()) < 10) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = len(out.read_text().splitlines())
    assert 10 <= killed_at < n
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"already in {out}" in done.stderr
    rows = read_jsonl(out)
    assert sorted(r["custom_id"] for r in rows) == sorted(f"line-{i + 1}" for i in range(n))
    assert all(r["error"] is None for r in rows)
    for row in rows:
        i = int(row["custom_id"].removeprefix("line-")) - 1
        assert row["response"]["body"]["usage"]["completion_tokens"] == 24 + 8 * (i % 5)
    # Every line's job ran exactly once, across the kill and the rerun.
    jobs = {job_id_of(r) for r in rows}
    assert len(jobs) == n and all(served.executions(j) == 1 for j in jobs)
    served.wait_idle()
    assert served.job_counts()[0] - counts_before[0] == n


def test_pinned_fields_override_every_line():
    parsed = parse_line(
        '{"prompt": "hi", "priority": 1}', 4, pinned={"tenant": "t-1", "priority": 3}
    )
    assert (parsed.request.tenant, parsed.request.priority) == ("t-1", 3)
    bad = parse_line('{"prompt": "hi"}', 5, pinned={"tenant": "no spaces"})
    assert bad.request is None and "tenant" in bad.error
