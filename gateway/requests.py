"""OpenAI chat and completions bodies as pagedq requests (the online endpoints)."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from gateway.config import Tenant
from gateway.errors import APIError
from gateway.grammar_check import check_constraint
from producer.chat_answer import AnswerFormat
from producer.contract.schema import MAX_SEED, GenerationRequest
from producer.errors import InvalidRequestError
from producer.openai_fields import openai_fields
from producer.openai_output import CHAT_URL

# OpenAI fields read by the gateway itself, or bookkeeping (producer/openai_fields.py: the rest).
DROPPED = ("model", "stream", "stream_options", "metadata")
# pagedq's own fields a caller may not set: the API key decides them.
PINNED = ("tenant", "priority", "custom_id")


@dataclass(slots=True)
class Online:
    """A parsed online request: the job, and how to answer it."""

    request: GenerationRequest
    url: str
    model: str | None
    stream: bool
    include_usage: bool
    top_k: int | None
    # How a chat answer is cut into reasoning, content and tool calls (set once routed).
    answer: AnswerFormat = field(default_factory=AnswerFormat)


async def json_object(request) -> dict[str, Any]:
    """The request's JSON body, which must be an object; APIError 400 otherwise."""
    try:
        body = json.loads(await request.body())
    except ValueError:
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def model_and_stream(body: dict[str, Any]) -> tuple[str | None, bool]:
    """A body's ``model`` (a string or absent) and ``stream`` (a boolean, default false)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, f"model must be a string, got {model!r:.80}", param="model")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise APIError(400, f"stream must be a boolean, got {stream!r:.80}", param="stream")
    return model, stream


def parse_online(body: dict[str, Any], url: str, tenant: Tenant) -> Online:
    """Validate a /v1/chat/completions or /v1/completions body; APIError 400 names the field."""
    model, stream = model_and_stream(body)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", param="stream_options")
    try:
        fields = openai_fields(body, url)
    except ValueError as exc:
        raise APIError(400, str(exc), param=str(exc).split(":")[0]) from None
    for name in DROPPED:
        fields.pop(name, None)
    for name in PINNED:
        if name in fields:
            raise APIError(400, f"unknown field {name!r}", param=name)
    if url == CHAT_URL:
        if "messages" not in body:
            raise APIError(400, "messages is required", param="messages")
        if "prompt" in fields:
            raise APIError(400, "use messages, not prompt, with chat completions", param="prompt")
        _chat_logprobs(fields)
    else:
        if "prompt" not in body:
            raise APIError(400, "prompt is required", param="prompt")
        _one_prompt(fields)
    if "max_completion_tokens" in fields:
        if "max_tokens" in fields:
            raise APIError(
                400, "give max_tokens or max_completion_tokens, not both", param="max_tokens"
            )
        fields["max_tokens"] = fields.pop("max_completion_tokens")
    # A re-run after a worker died then samples the same tokens, so a stream can carry on.
    if fields.get("temperature", 1.0) != 0 and "seed" not in fields:
        fields["seed"] = secrets.randbelow(MAX_SEED)
    if tenant.name is not None:
        fields["tenant"] = tenant.name
    fields["priority"] = tenant.priority
    fields["stream"] = stream
    try:
        request = GenerationRequest.parse(fields)
    except InvalidRequestError as exc:
        param = ".".join(str(p) for p in exc.errors[0]["loc"]) if exc.errors else None
        raise APIError(400, str(exc), param=param or None) from None
    if request.structured_outputs is not None:
        check_constraint(request.structured_outputs, body)
    top_k = request.logprobs
    if url == CHAT_URL and body.get("logprobs") is not True:
        top_k = None
    return Online(request, url, model, stream, bool(options.get("include_usage")), top_k)


def _chat_logprobs(fields: dict[str, Any]) -> None:
    wanted, top = fields.pop("logprobs", False), fields.pop("top_logprobs", 0)
    if not isinstance(wanted, bool):
        raise APIError(400, "logprobs must be a boolean", param="logprobs")
    if wanted:
        fields["logprobs"] = top


def _one_prompt(fields: dict[str, Any]) -> None:
    prompt = fields["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) != 1:
            raise APIError(
                400, "one prompt per request (send one request per prompt)", param="prompt"
            )
        fields["prompt"] = prompt[0]
