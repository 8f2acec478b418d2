"""OpenAI batch output bodies from a GenerationResult: exact chat and completion shapes."""

from __future__ import annotations

from producer.contract.schema import GenerationResult
from producer.openai_output import CHAT_URL, COMPLETIONS_URL, BatchOutputLine, result_line

# Two generated tokens, " Paris" (id 7) then "." (id 9); at position 0 the sampled token is not
# the likeliest one (sampling), so it must still be reported with its own logprob.
RESULT = {
    "job_id": "pq-1",
    "status": "finished",
    "text": " Paris.",
    "token_ids": [7, 9],
    "finish_reason": "stop",
    "logprobs": [{7: -0.5, 3: -0.25, 4: -3.0}, {9: -0.1, 5: -2.5}],
    "token_texts": {7: " Paris", 3: " Lyon", 4: " Nice", 9: ".", 5: "!"},
    "usage": {"prompt_tokens": 5, "completion_tokens": 2},
    "model": "smollm2",
}


def test_chat_logprobs_content_has_token_logprob_bytes_and_top_k():
    line = result_line("c1", CHAT_URL, GenerationResult.model_validate(RESULT), top_k=2)
    body = line.response.body
    assert (body.object, body.id, body.model) == ("chat.completion", "chatcmpl-pq-1", "smollm2")
    assert body.usage.model_dump() == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
    }
    [choice] = body.choices
    assert choice.message.content == " Paris." and choice.finish_reason == "stop"
    first, second = choice.logprobs.model_dump()["content"]
    assert first == {
        "token": " Paris",
        "logprob": -0.5,
        "bytes": [32, 80, 97, 114, 105, 115],
        "top_logprobs": [
            {"token": " Lyon", "logprob": -0.25, "bytes": [32, 76, 121, 111, 110]},
            {"token": " Paris", "logprob": -0.5, "bytes": [32, 80, 97, 114, 105, 115]},
        ],
    }
    assert [t["token"] for t in second["top_logprobs"]] == [".", "!"]
    assert line.id == "batch_req_pq-1" and line.error is None
    assert line.response.status_code == 200 and line.response.request_id == "pq-1"


def test_completion_logprobs_are_parallel_lists_with_text_offsets():
    line = result_line("c2", COMPLETIONS_URL, GenerationResult.model_validate(RESULT), top_k=1)
    body = line.response.body
    assert (body.object, body.id) == ("text_completion", "cmpl-pq-1")
    logprobs = body.choices[0].logprobs.model_dump()
    assert logprobs == {
        "tokens": [" Paris", "."],
        "token_logprobs": [-0.5, -0.1],
        # top-1 plus the sampled token, as vLLM writes them
        "top_logprobs": [{" Lyon": -0.25, " Paris": -0.5}, {".": -0.1}],
        "text_offset": [0, 6],
    }


def test_without_token_texts_tokens_are_named_by_id_and_logprobs_only_when_asked():
    result = GenerationResult.model_validate({**RESULT, "token_texts": None})
    content = result_line("c", CHAT_URL, result, top_k=0).response.body.choices[0].logprobs
    assert [(t.token, t.bytes, t.top_logprobs) for t in content.content] == [
        ("token_id:7", None, []),
        ("token_id:9", None, []),
    ]
    assert result_line("c", CHAT_URL, result, top_k=None).response.body.choices[0].logprobs is None


def test_failed_and_canceled_jobs_get_openai_error_shapes():
    failed = GenerationResult(job_id="pq-2", status="failed", error="prompt too long")
    line = result_line("f", CHAT_URL, failed).model_dump(mode="json")
    assert line == {
        "id": "batch_req_pq-2",
        "custom_id": "f",
        "response": {
            "status_code": 500,
            "request_id": "pq-2",
            "body": {
                "error": {
                    "message": "prompt too long",
                    "type": "server_error",
                    "param": None,
                    "code": "job_failed",
                }
            },
        },
        "error": None,
    }
    canceled = GenerationResult(job_id="pq-3", status="canceled", error="canceled")
    line = result_line("k", CHAT_URL, canceled)
    assert line.response is None
    assert line.error.model_dump() == {"code": "batch_cancelled", "message": "canceled"}
    assert BatchOutputLine.model_validate_json(line.model_dump_json()) == line


def test_a_request_the_worker_refused_is_a_400_line_not_a_500():
    refused = GenerationResult(
        job_id="j",
        status="failed",
        error="invalid request: structured_outputs.json: unsupported keyword",
    )
    line = result_line("r", CHAT_URL, refused).model_dump(mode="json")
    assert line["response"]["status_code"] == 400
    assert line["response"]["body"]["error"]["type"] == "invalid_request_error"
    crashed = GenerationResult(job_id="j", status="failed", error="engine error: boom")
    assert result_line("r", CHAT_URL, crashed).response.status_code == 500
