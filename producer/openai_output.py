"""OpenAI Batch API output lines, as typed models: chat completions, completions, errors.

The shapes follow OpenAI's API reference (chat.completion, text_completion, the batch output
line with `response` or `error`), so OpenAI's own client types parse every line we write.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel

from producer.contract.schema import Choice, GenerationResult
from producer.openai_endpoints import endpoint_body

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"


class TopLogprob(BaseModel):
    """One candidate token at a position (chat `top_logprobs[]`)."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    """The sampled token at a position, with the most likely candidates (chat)."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """`choices[].logprobs` of a chat completion."""

    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    """The assistant message of a chat choice."""

    role: Literal["assistant"] = "assistant"
    content: str
    refusal: str | None = None


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class CompletionLogprobs(BaseModel):
    """`choices[].logprobs` of a (legacy) text completion."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    """One choice of a text completion."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionUsage(BaseModel):
    """Token counts, as OpenAI reports them."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    """The body of a finished /v1/chat/completions request."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    system_fingerprint: str | None = None


class Completion(BaseModel):
    """The body of a finished /v1/completions request."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage
    system_fingerprint: str | None = None


class ErrorDetail(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """The body of a request that failed with an HTTP error."""

    error: ErrorDetail


class BatchResponse(BaseModel):
    """`response` of an output line: the HTTP status and body the request would have had."""

    status_code: int
    request_id: str
    # A Responses object or an embeddings list (producer/openai_endpoints.py) as a dict.
    body: ChatCompletion | Completion | ErrorBody | dict[str, Any]


class BatchError(BaseModel):
    """`error` of an output line whose request ended without an HTTP response (canceled)."""

    code: str
    message: str


class BatchOutputLine(BaseModel):
    """One line of an OpenAI batch output (or error) file."""

    id: str
    custom_id: str
    response: BatchResponse | None
    error: BatchError | None


def token_text(texts: dict[int, str], token_id: int) -> str:
    """The text of a token id, from the result's `token_texts` when the worker sent them.

    Without them, vLLM's `return_tokens_as_token_ids` form "token_id:<id>" stands for it.
    """
    text = texts.get(token_id)
    return text if text is not None else f"token_id:{token_id}"


def _bytes(texts: dict[int, str], token_id: int) -> list[int] | None:
    text = texts.get(token_id)
    return None if text is None else list(text.encode("utf-8", errors="replace"))


def _token_texts(result: GenerationResult, choice: Choice) -> dict[int, str]:
    # `token_texts` is optional in the result schema: workers that do not send it still work.
    texts = getattr(choice, "token_texts", None) or getattr(result, "token_texts", None)
    return texts or {}


def _positions(choice: Choice) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """(sampled id, its logprob, candidates by descending logprob) per generated token."""
    positions = []
    for token_id, candidates in zip(choice.token_ids, choice.logprobs or []):
        ranked = sorted(candidates.items(), key=lambda kv: (-kv[1], kv[0]))
        logprob = candidates.get(token_id, ranked[0][1] if ranked else 0.0)
        positions.append((token_id, logprob, ranked))
    return positions


def chat_logprobs(choice: Choice, top_k: int, texts: dict[int, str]) -> ChatLogprobs:
    """`logprobs.content[]` of a chat choice; `top_logprobs` holds the `top_k` likeliest."""
    content = []
    for token_id, logprob, ranked in _positions(choice):
        top = [
            TopLogprob(token=token_text(texts, t), logprob=lp, bytes=_bytes(texts, t))
            for t, lp in ranked[:top_k]
        ]
        content.append(
            ChatTokenLogprob(
                token=token_text(texts, token_id),
                logprob=logprob,
                bytes=_bytes(texts, token_id),
                top_logprobs=top,
            )
        )
    return ChatLogprobs(content=content)


def completion_logprobs(choice: Choice, top_k: int, texts: dict[int, str]) -> CompletionLogprobs:
    """`logprobs` of a text-completion choice; `text_offset` counts characters of the text."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    offset = 0
    for token_id, logprob, ranked in _positions(choice):
        text = token_text(texts, token_id)
        tokens.append(text)
        token_logprobs.append(logprob)
        # Like vLLM, the sampled token is always among a position's top_logprobs.
        top = {token_text(texts, t): lp for t, lp in ranked[:top_k]}
        top.setdefault(text, logprob)
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(text)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=token_logprobs,
        top_logprobs=top_logprobs,
        text_offset=text_offset,
    )


def completion_body(result: GenerationResult, url: str, top_k: int | None) -> BaseModel:
    """The ChatCompletion or Completion body of a finished result.

    `top_k` is the request's `logprobs` (None: none asked for, `logprobs` is null).
    """
    usage = CompletionUsage(
        prompt_tokens=result.usage.prompt_tokens,
        completion_tokens=result.usage.completion_tokens,
        total_tokens=result.usage.total_tokens,
    )
    created, model = int(time.time()), result.model or ""
    wants = top_k is not None
    if url == CHAT_URL:
        chat_choices = [
            ChatChoice(
                index=c.index,
                message=ChatMessageOut(content=c.text),
                logprobs=chat_logprobs(c, top_k, _token_texts(result, c))
                if wants and c.logprobs is not None
                else None,
                finish_reason=c.finish_reason,
            )
            for c in result.all_choices()
        ]
        return ChatCompletion(
            id=f"chatcmpl-{result.job_id}",
            created=created,
            model=model,
            choices=chat_choices,
            usage=usage,
        )
    choices = [
        CompletionChoice(
            index=c.index,
            text=c.text,
            logprobs=completion_logprobs(c, top_k, _token_texts(result, c))
            if wants and c.logprobs is not None
            else None,
            finish_reason=c.finish_reason,
        )
        for c in result.all_choices()
    ]
    return Completion(
        id=f"cmpl-{result.job_id}", created=created, model=model, choices=choices, usage=usage
    )


def result_line(
    custom_id: str,
    url: str,
    result: GenerationResult,
    top_k: int | None = None,
    *,
    options: dict | None = None,
) -> BatchOutputLine:
    """The output line of an ended job.

    finished: status 200 and the completion body; failed: status 500 with a `server_error`
    body (OpenAI's shape for a request that failed); canceled: no response and the error
    `batch_cancelled`, as OpenAI writes for requests of a cancelled batch.
    """
    job_id = result.job_id
    line_id = f"batch_req_{job_id}"
    if result.status == "canceled":
        error = BatchError(code="batch_cancelled", message=result.error or "canceled")
        return BatchOutputLine(id=line_id, custom_id=custom_id, response=None, error=error)
    if result.status != "finished":
        detail = ErrorDetail(
            message=result.error or "the job failed", type="server_error", code="job_failed"
        )
        response = BatchResponse(status_code=500, request_id=job_id, body=ErrorBody(error=detail))
        return BatchOutputLine(id=line_id, custom_id=custom_id, response=response, error=None)
    if url in (CHAT_URL, COMPLETIONS_URL):
        body = completion_body(result, url, top_k)
    else:
        body = endpoint_body(result, url, options)
    response = BatchResponse(status_code=200, request_id=job_id, body=body)
    return BatchOutputLine(id=line_id, custom_id=custom_id, response=response, error=None)


def invalid_request_line(
    line_id: str, custom_id: str, message: str, param: str | None = None
) -> BatchOutputLine:
    """The output line of a request refused before it became a job: HTTP 400, as OpenAI does."""
    detail = ErrorDetail(message=message, type="invalid_request_error", param=param)
    response = BatchResponse(status_code=400, request_id=line_id, body=ErrorBody(error=detail))
    return BatchOutputLine(
        id=f"batch_req_{line_id}", custom_id=custom_id, response=response, error=None
    )
