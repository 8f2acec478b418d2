"""POST /v1/chat/completions and /v1/completions: one job each, answered whole or streamed.

A request becomes a job with its key's tenant and priority; its answer is read from the job's
token stream (through the gateway's StreamHub) and its result key. A client that goes away
before the job ended cancels it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sse_starlette import EventSourceResponse

from gateway.auth import TenantDep
from gateway.config import Tenant
from gateway.errors import APIError, error_body
from gateway.metrics import CANCELED_ON_DISCONNECT, OPEN_STREAMS, TTFT
from gateway.requests import Online, json_object, parse_online
from gateway.sse import DONE, ChunkWriter, Relay, StreamDiverged
from gateway.stream_hub import Follow
from gateway.stream_parts import StreamParts
from producer.chat_answer import AnswerFormat
from producer.contract.keys import result_key
from producer.contract.schema import GenerationResult
from producer.contract.stream import MAX_INLINE_RESULT_CHARS, RESULT_FIELD
from producer.openai_output import CHAT_URL, COMPLETIONS_URL, completion_body, refused_by_worker
from producer.results import MAX_READ_BYTES, is_final

router = APIRouter()
# How long a reader waits for the result key after a `done` entry (workers write it first).
RESULT_GRACE_S = 2.0
PING_S = 15


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, tenant: TenantDep) -> Any:
    """OpenAI's chat completions (stream=True answers with server-sent events)."""
    return await _answer(request, tenant, CHAT_URL)


@router.post("/v1/completions")
async def completions(request: Request, tenant: TenantDep) -> Any:
    """OpenAI's (legacy) text completions (stream=True answers with server-sent events)."""
    return await _answer(request, tenant, COMPLETIONS_URL)


async def _answer(request: Request, tenant: Tenant, url: str) -> Any:
    online = parse_online(await json_object(request), url, tenant)
    state = request.app.state
    await state.limiter.admit(online.request.priority, _estimated_tokens(online))
    routed = await state.catalog.route(online.model)
    if routed is not None:
        online.request = online.request.model_copy(update={"model": routed})
    started = time.perf_counter()
    job_id = await state.enqueuer.submit(online.request)
    follow = state.hub.follow(job_id)
    model = routed or await _default_model(request, online.model)
    config = state.config
    formats = await state.catalog.formats(model)
    online.answer = AnswerFormat.of(
        online.request,
        None,
        config.tool_call_parser or formats.get("tool_call_parser"),
        config.reasoning_parser or formats.get("reasoning_parser"),
    )
    if online.stream:
        chunks = _stream(request, online, follow, model, started)
        return EventSourceResponse(chunks, ping=PING_S)
    return await _whole(request, online, follow)


def _estimated_tokens(online: Online) -> int:
    request = online.request
    chars = len(request.prompt or "") if isinstance(request.prompt, str) else 0
    chars += sum(len(m.content or "") for m in request.messages or [])
    return chars // 4 + request.max_tokens * request.n


async def _default_model(request: Request, asked: str | None) -> str:
    served = await request.app.state.catalog.models()
    return served[0]["id"] if len(served) == 1 else asked or ""


async def _whole(request: Request, online: Online, follow: Follow) -> Any:
    hub = request.app.state.hub
    ended = False
    waiting = asyncio.ensure_future(_final_entry(follow))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done():
            return JSONResponse(error_body("client went away", "server_error"), 499)
        ended = True
        result = await _result(request, follow.job_id, waiting.result())
    finally:
        waiting.cancel()
        gone.cancel()
        hub.unfollow(follow)
        if not ended:
            _cancel(request, follow.job_id)
    if result.status != "finished":
        raise _job_error(result)
    request.app.state.limiter.observe(result.usage.total_tokens)
    answer = _answer_format(request, online, result)
    return completion_body(result, online.url, online.top_k, answer).model_dump(mode="json")


def _answer_format(request: Request, online: Online, result: GenerationResult) -> AnswerFormat:
    """The serve flags' parsers, else those of the worker that ran the job."""
    config = request.app.state.config
    return AnswerFormat.of(online.request, result, config.tool_call_parser, config.reasoning_parser)


async def _final_entry(follow: Follow) -> dict[str, str]:
    while True:
        entry = await follow.entries.get()
        if is_final(entry):
            return entry


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (its body was read: nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(
    request: Request, online: Online, follow: Follow, model: str, started: float
) -> AsyncIterator[dict[str, str]]:
    hub = request.app.state.hub
    writer = ChunkWriter(online, follow.job_id, model)
    parts = StreamParts(online.answer, follow.job_id) if writer.chat else None
    relay = Relay()
    ended = False
    OPEN_STREAMS.inc()
    try:
        if writer.chat:
            yield {"data": writer.chunk(0, "", role=True)}
        while True:
            entry = await follow.entries.get()
            new = ""
            # Entries that queued up while the client was being written to go out as one
            # chunk: under load, fewer and larger events.
            while not is_final(entry):
                new += relay.take(entry)
                if follow.entries.empty():
                    break
                entry = follow.entries.get_nowait()
            if is_final(entry):
                ended = True
            if new:
                if not relay.first_sent:
                    relay.first_sent = True
                    TTFT.observe(time.perf_counter() - started)
                if parts is None:
                    yield {"data": writer.chunk(0, new)}
                for delta in parts.update(relay.sent) if parts is not None else ():
                    yield {"data": writer.delta(0, delta)}
            if ended:
                break
        result = await _result(request, follow.job_id, entry)
        if result.status != "finished":
            err = _job_error(result)
            yield {"data": json.dumps(error_body(err.message, err.type, code=err.code))}
            return
        request.app.state.limiter.observe(result.usage.total_tokens)
        first = result.all_choices()[0]
        answer = _answer_format(request, online, result)
        if parts is not None:
            # The whole answer completes what was streamed (and any stream entries lost).
            parts.answer = answer
            whole = answer.parts(first.text, first.finish_reason, result.job_id, 0)
            for delta in parts.finish(whole):
                yield {"data": writer.delta(0, delta)}
        elif first.text.startswith(relay.sent) and len(first.text) > len(relay.sent):
            # The stream lost entries (expired or trimmed): the result holds the whole text.
            yield {"data": writer.chunk(0, first.text[len(relay.sent) :])}
        for chunk in writer.final(result, answer):
            yield {"data": chunk}
        if online.include_usage:
            yield {"data": writer.usage(result)}
        yield {"data": DONE}
    except StreamDiverged as exc:
        yield {"data": json.dumps(error_body(str(exc), "server_error", code="stream_diverged"))}
    finally:
        OPEN_STREAMS.dec()
        hub.unfollow(follow)
        if not ended:
            _cancel(request, follow.job_id)


def _cancel(request: Request, job_id: str) -> None:
    """Cancel a job whose client went away, without waiting (this task may be cancelled)."""
    CANCELED_ON_DISCONNECT.inc()
    loop = asyncio.get_running_loop()
    loop.run_in_executor(None, request.app.state.client.cancel, job_id)


async def _result(request: Request, job_id: str, entry: dict[str, str]) -> GenerationResult:
    """The result of a job whose final entry was read: the result it carries (an inline hub's
    entry), else its result key, else what the entry says."""
    inline = entry.get(RESULT_FIELD)
    if inline is not None and len(inline) <= MAX_INLINE_RESULT_CHARS:
        try:
            return GenerationResult.model_validate_json(inline)
        except ValidationError:
            pass
    redis = request.app.state.hub.redis
    deadline = time.monotonic() + (RESULT_GRACE_S if entry.get("event") == "done" else 0)
    while True:
        raw = await redis.get(result_key(job_id))
        if raw is not None or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.05)
    if raw is not None and len(raw) <= MAX_READ_BYTES:
        try:
            return GenerationResult.model_validate_json(raw)
        except ValidationError:
            pass
    canceled = entry.get("status") == "canceled" or entry.get("error") == "canceled"
    status = "canceled" if canceled else "failed"
    return GenerationResult(job_id=job_id, status=status, error=entry.get("error") or "no result")


def _job_error(result: GenerationResult) -> APIError:
    if result.status == "canceled":
        return APIError(500, "the request was canceled", code="canceled", type="server_error")
    refused = refused_by_worker(result.error)
    if refused is not None:
        param = refused.split(": ", 2)[1] if refused.count(": ") >= 2 else None
        return APIError(400, refused, param=param)
    return APIError(500, f"the request failed: {result.error or 'no message'}", code="job_failed")
