"""Enqueue one job for an online request and wait for its whole result (embeddings, whole
Responses): the chat endpoints' way, shared with the endpoints that answer in one body."""

from __future__ import annotations

import asyncio
import re
import time

from fastapi import Request

from gateway.completions import _cancel, _disconnected, _final_entry, _job_error, _result
from gateway.errors import APIError
from producer.contract.schema import GenerationRequest, GenerationResult

# "invalid request: dimensions: must be ..." (a worker's refusal) -> the field it names.
_REFUSED_FIELD = re.compile(r"^invalid request: ([a-z_]+)(\[\d+\])?:")


class ClientGone(Exception):
    """The client hung up before its job ended (the job was canceled)."""


async def submit(request: Request, job: GenerationRequest, model: str | None) -> tuple[str, str]:
    """Enqueue `job` routed to `model`; (job id, the model name to answer with)."""
    state = request.app.state
    routed = await state.catalog.route(model)
    if routed is not None:
        job = job.model_copy(update={"model": routed})
    job_id = await state.enqueuer.submit(job)
    if routed is None:
        served = await state.catalog.models()
        routed = served[0]["id"] if len(served) == 1 else model or ""
    return job_id, routed


async def whole_result(request: Request, job_id: str) -> GenerationResult:
    """The job's result once it ended; ClientGone (and the job canceled) if the client left."""
    hub = request.app.state.hub
    follow = hub.follow(job_id)
    ended = False
    waiting = asyncio.ensure_future(_final_entry(follow))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done():
            raise ClientGone(job_id)
        ended = True
        return await _result(request, job_id, waiting.result())
    finally:
        waiting.cancel()
        gone.cancel()
        hub.unfollow(follow)
        if not ended:
            _cancel(request, job_id)


def job_error(result: GenerationResult) -> APIError:
    """A job that did not finish as an HTTP error: a worker's refusal of a field is a 400
    naming it (e.g. `dimensions` over the hidden size), anything else a 500."""
    match = _REFUSED_FIELD.match(result.error or "") if result.status == "failed" else None
    if match:
        message = (result.error or "").removeprefix("invalid request: ")
        return APIError(400, message, param=match.group(1))
    return _job_error(result)


def now() -> int:
    """Unix seconds, for `created` / `created_at`."""
    return int(time.time())
