"""`pagedq submit`: OpenAI batch lines in, OpenAI batch output out, resumable, nothing twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from producer.bulk import BulkRun, count_lines, load_done, run_bulk
from producer.openai_batch import CHAT_URL, COMPLETIONS_URL, parse_line


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
    ("raw", "custom_id", "message"),
    [
        ("{not json", "line-3", "line 3: invalid JSON"),
        ("[1, 2]", "line-3", "line 3: not a JSON object"),
        ('{"custom_id": 5, "prompt": "x"}', "line-3", "custom_id must be a non-empty str"),
        (openai_line("b", "x", max_tokens=0), "b", "max_tokens: must be >= 1, got 0"),
        (openai_line("b", "x", tools=[]), "b", "tools: unknown field"),
        ('{"custom_id": "b", "url": "/v1/embeddings", "body": {}}', "b", "url must be"),
        ('{"custom_id": "b", "method": "GET", "body": {"prompt": "x"}}', "b", "method must be"),
    ],
)
def test_bad_lines_become_errors_not_exceptions(raw, custom_id, message):
    parsed = parse_line(raw, 3)
    assert parsed.request is None and parsed.custom_id == custom_id
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
        "{broken",
        openai_line("bad", "x", top_p=7),
        openai_line("fails", "word " * 600),  # longer than the worker's max_model_len
        openai_line("req-0", "duplicate"),
    ]
    src.write_text("\n".join(lines) + "\n")
    summary = run_bulk(client, str(src), str(out), progress=False, chunk_size=3, window=4)
    rows = {row["custom_id"]: row for row in read_jsonl(out)}
    assert len(read_jsonl(out)) == len(rows) == 9
    assert (summary.finished, summary.failed, summary.invalid) == (6, 1, 2)
    assert summary.duplicates == ["req-0"] and summary.completion_tokens == 6 * 4

    ok = rows["req-2"]
    assert ok["error"] is None and ok["id"].startswith("batch_req_pq-")
    result = client.result(job_id_of(ok))  # what the worker wrote
    body = ok["response"]["body"]
    assert ok["response"]["status_code"] == 200 and body["object"] == "chat.completion"
    assert body["model"] == served.model
    assert body["choices"][0]["message"] == {"role": "assistant", "content": result.text}
    assert body["choices"][0]["token_ids"] == result.token_ids and len(result.token_ids) == 4
    assert body["choices"][0]["finish_reason"] == "length"
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
    assert rows["line-8"]["error"]["code"] == "invalid_request"
    assert "invalid JSON" in rows["line-8"]["error"]["message"]
    assert "top_p: must be in (0, 1], got 7" in rows["bad"]["error"]["message"]
    assert rows["fails"]["response"] is None
    assert rows["fails"]["error"]["code"] == "job_failed"
    assert "must be shorter than max_model_len" in rows["fails"]["error"]["message"]
    # Each of the 7 jobs ran once: 6 finished and 1 failed execution, nothing more.
    jobs = [job_id_of(r) for r in rows.values() if r["response"] or r["custom_id"] == "fails"]
    assert len(jobs) == 7 and [served.executions(j) for j in jobs] == [1] * 7
    served.wait_idle()
    successful, failed = served.job_counts()
    assert (successful - counts_before[0], failed - counts_before[1]) == (6, 1)


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
