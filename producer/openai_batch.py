"""OpenAI Batch API lines in, OpenAI batch output lines out (plus plain {"prompt": ...} lines)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from producer.errors import InvalidRequestError
from producer.schema import GenerationRequest, GenerationResult

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
# Body fields of OpenAI requests that mean nothing here: the model is the worker's (use
# `pagedq submit --model` to pin it), a batch never streams, and the rest is bookkeeping.
IGNORED_BODY_FIELDS = ("model", "user", "store", "stream", "stream_options", "service_tier")


@dataclass(slots=True)
class ParsedLine:
    """One input line: its custom_id, and either a valid request or the reason it was refused."""

    line_no: int
    custom_id: str
    url: str
    request: GenerationRequest | None = None
    error: str | None = None


def parse_line(raw: str, line_no: int, model: str | None = None) -> ParsedLine:
    """Parse one JSONL line; a bad line yields a ParsedLine with `error` set, never an exception."""
    custom_id = f"line-{line_no}"
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return ParsedLine(
            line_no, custom_id, CHAT_URL, error=f"line {line_no}: invalid JSON: {exc}"
        )
    if not isinstance(obj, dict):
        return ParsedLine(line_no, custom_id, CHAT_URL, error=f"line {line_no}: not a JSON object")
    if "custom_id" in obj:
        if not isinstance(obj["custom_id"], str) or not obj["custom_id"]:
            error = f"line {line_no}: custom_id must be a non-empty str, got {obj['custom_id']!r}"
            return ParsedLine(line_no, custom_id, CHAT_URL, error=error)
        custom_id = obj["custom_id"]
    is_openai = any(k in obj for k in ("body", "url", "method"))
    try:
        fields, url = _openai_fields(obj) if is_openai else _plain_fields(obj)
        fields["custom_id"] = custom_id
        if model is not None:
            fields["model"] = model
        return ParsedLine(line_no, custom_id, url, request=GenerationRequest.parse(fields))
    except (InvalidRequestError, ValueError) as exc:
        url = obj.get("url") if isinstance(obj.get("url"), str) else CHAT_URL
        return ParsedLine(line_no, custom_id, url, error=f"line {line_no}: {exc}")


def _plain_fields(obj: dict[str, Any]) -> tuple[dict[str, Any], str]:
    fields = dict(obj)
    return fields, CHAT_URL if "messages" in fields else COMPLETIONS_URL


def _openai_fields(obj: dict[str, Any]) -> tuple[dict[str, Any], str]:
    extra = set(obj) - {"custom_id", "method", "url", "body"}
    if extra:
        raise ValueError(
            f"unknown top-level field(s) {sorted(extra)}; allowed: custom_id, method, url, body"
        )
    if obj.get("method", "POST") != "POST":
        raise ValueError(f"method must be POST, got {obj.get('method')!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    url = obj.get("url") or (CHAT_URL if "messages" in body else COMPLETIONS_URL)
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise ValueError(f"url must be {CHAT_URL} or {COMPLETIONS_URL}, got {url!r}")
    fields = {k: v for k, v in body.items() if k not in IGNORED_BODY_FIELDS}
    if "max_completion_tokens" in fields:
        if "max_tokens" in fields:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        fields["max_tokens"] = fields.pop("max_completion_tokens")
    if url == CHAT_URL and ("logprobs" in fields or "top_logprobs" in fields):
        # Chat asks with a boolean plus a top-k; pagedq takes the top-k alone.
        wanted, top = fields.pop("logprobs", False), fields.pop("top_logprobs", 0)
        if wanted is True:
            fields["logprobs"] = top
    return fields, url


def result_line(custom_id: str, url: str, result: GenerationResult) -> dict[str, Any]:
    """The OpenAI batch output line of an ended job (an `error` line unless it finished)."""
    job_id = result.job_id
    if result.status != "finished":
        code = "canceled" if result.status == "canceled" else "job_failed"
        return _line(job_id, custom_id, None, {"code": code, "message": result.error or code})
    chat = url == CHAT_URL
    choices = []
    for c in result.all_choices():
        choice: dict[str, Any] = {"index": c.index}
        if chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        choice.update(logprobs=None, finish_reason=c.finish_reason, token_ids=c.token_ids)
        if c.logprobs is not None:
            choice["token_logprobs"] = [{str(k): v for k, v in d.items()} for d in c.logprobs]
        choices.append(choice)
    usage = result.usage
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{job_id}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": result.model,
        "choices": choices,
        "usage": {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
        },
    }
    response = {"status_code": 200, "request_id": job_id, "body": body}
    return _line(job_id, custom_id, response, None)


def error_line(parsed: ParsedLine) -> dict[str, Any]:
    """The OpenAI batch output line of an input line that could not become a job."""
    error = {"code": "invalid_request", "message": parsed.error}
    return _line(f"line{parsed.line_no}", parsed.custom_id, None, error)


def _line(job_id: str, custom_id: str, response: Any, error: Any) -> dict[str, Any]:
    return {
        "id": f"batch_req_{job_id}",
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }
