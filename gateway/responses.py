"""OpenAI's Responses API: POST /v1/responses (whole or streamed), GET and DELETE
/v1/responses/{id}.

A response is one chat job (producer/openai_responses.py says which fields do what). With
`store` (OpenAI's default) the finished Response and its conversation are kept in Redis under
`response_key(id)` for the gateway's result TTL, readable by the key's tenant only; a request
naming `previous_response_id` continues that conversation (its earlier turns come before the
new input; its instructions do not carry over, as OpenAI does).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from gateway.auth import TenantDep
from gateway.completions import PING_S
from gateway.config import Tenant
from gateway.errors import APIError, error_body, not_found
from gateway.job_wait import ClientGone, job_error, now, submit, whole_result
from gateway.keys import response_key
from gateway.requests import json_object, model_and_stream
from gateway.responses_stream import response_events
from producer.contract.schema import MAX_SEED, GenerationRequest
from producer.errors import InvalidRequestError
from producer.openai_responses import (
    ResponsesFieldError,
    input_messages,
    responses_fields,
)
from producer.openai_responses_output import output_messages, response_object

router = APIRouter()


@router.post("/v1/responses")
async def create_response(request: Request, tenant: TenantDep) -> Any:
    """Create a model response (stream=True answers with the Responses API's events)."""
    body = await json_object(request)
    model, stream = model_and_stream(body)
    history = await _history(request, body.get("previous_response_id"), tenant)
    try:
        fields, options = responses_fields(body, history)
        conversation = history + input_messages(body["input"])
    except ResponsesFieldError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    # A re-run after a worker died then samples the same tokens, so a stream can carry on.
    if fields.get("temperature", 1.0) != 0:
        fields["seed"] = secrets.randbelow(MAX_SEED)
    if tenant.name is not None:
        fields["tenant"] = tenant.name
    fields.update(priority=tenant.priority, stream=True)
    try:
        job = GenerationRequest.parse(fields)
    except InvalidRequestError as exc:
        param = ".".join(str(p) for p in exc.errors[0]["loc"]) if exc.errors else None
        raise APIError(400, str(exc), param=param or None) from None
    job_id, served = await submit(request, job, model)
    created = now()

    async def store(response: dict[str, Any]) -> None:
        if options.store:
            turns = conversation + output_messages(response["output"])
            await _store(request, tenant, response, turns)

    if stream:
        events = response_events(request, job_id, options, served, created, store)
        return EventSourceResponse(events, ping=PING_S)
    try:
        result = await whole_result(request, job_id)
    except ClientGone:
        return JSONResponse(error_body("client went away", "server_error"), 499)
    if result.status != "finished":
        raise job_error(result)
    response = response_object(job_id, options, served, created, result)
    await store(response)
    return response


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request, tenant: TenantDep) -> Any:
    """A stored response (404 once expired, or when another key's)."""
    stored = await _load(request, response_id, tenant)
    if stored is None:
        raise not_found("response", response_id)
    return stored["response"]


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request, tenant: TenantDep) -> Any:
    """Forget a stored response."""
    if await _load(request, response_id, tenant) is None:
        raise not_found("response", response_id)
    await request.app.state.hub.redis.delete(response_key(response_id))
    return {"id": response_id, "object": "response.deleted", "deleted": True}


async def _history(request: Request, previous: Any, tenant: Tenant) -> list[dict[str, Any]]:
    if previous is None:
        return []
    if not isinstance(previous, str):
        raise APIError(400, "previous_response_id must be a string", param="previous_response_id")
    stored = await _load(request, previous, tenant)
    if stored is None:
        raise APIError(
            400,
            f"previous_response_id: no stored response {previous!r:.80} (never stored, "
            "expired, or another key's)",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return stored["messages"]


async def _load(request: Request, response_id: str, tenant: Tenant) -> dict[str, Any] | None:
    raw = await request.app.state.hub.redis.get(response_key(response_id))
    if raw is None:
        return None
    stored = json.loads(raw)
    return stored if stored.get("owner") == (tenant.name or "") else None


async def _store(
    request: Request, tenant: Tenant, response: dict[str, Any], turns: list[dict[str, Any]]
) -> None:
    value = {"owner": tenant.name or "", "response": response, "messages": turns}
    ttl = request.app.state.config.result_ttl
    await request.app.state.hub.redis.set(response_key(response["id"]), json.dumps(value), ex=ttl)
