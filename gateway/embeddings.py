"""POST /v1/embeddings: one embedding job per request, its vectors answered whole."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.auth import TenantDep
from gateway.errors import APIError, error_body
from gateway.job_wait import ClientGone, job_error, submit, whole_result
from gateway.requests import json_object, model_and_stream
from producer.contract.schema import GenerationRequest
from producer.errors import InvalidRequestError
from producer.openai_embeddings import EmbeddingFieldError, embedding_body, embedding_fields

router = APIRouter()


@router.post("/v1/embeddings")
async def create_embeddings(request: Request, tenant: TenantDep) -> Any:
    """OpenAI's embeddings: one vector per input, pooled and normalised by the worker."""
    body = await json_object(request)
    model, _ = model_and_stream(body)
    try:
        fields, encoding = embedding_fields(body)
    except EmbeddingFieldError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    if tenant.name is not None:
        fields["tenant"] = tenant.name
    # The worker writes the job's final stream entry, which is what this request waits on.
    fields.update(priority=tenant.priority, stream=True)
    try:
        job = GenerationRequest.parse(fields)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=_param(exc)) from None
    job_id, served = await submit(request, job, model)
    try:
        result = await whole_result(request, job_id)
    except ClientGone:
        return JSONResponse(error_body("client went away", "server_error"), 499)
    if result.status != "finished":
        raise job_error(result)
    return embedding_body(result, encoding, served).model_dump(mode="json")


def _param(exc: InvalidRequestError) -> str | None:
    message = str(exc)
    for name in ("input", "dimensions"):
        if f" {name}" in message:
            return name
    return None
