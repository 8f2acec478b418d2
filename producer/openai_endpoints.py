"""The endpoints a batch line may name beyond chat and completions: `/v1/responses` and
`/v1/embeddings`; their bodies as job fields, and their results as response bodies."""

from __future__ import annotations

from typing import Any

from producer.contract.schema import GenerationResult
from producer.openai_embeddings import EMBEDDINGS_URL, embedding_body, embedding_fields
from producer.openai_responses import RESPONSES_URL, ResponseOptions, responses_fields
from producer.openai_responses_output import response_object

OTHER_URLS = (RESPONSES_URL, EMBEDDINGS_URL)


def line_fields(fields: dict[str, Any], url: str) -> tuple[dict[str, Any], dict | None]:
    """(job fields, output options) of a batch line's body; ValueError names a bad field."""
    if url == RESPONSES_URL:
        if fields.get("previous_response_id") is not None:
            raise ValueError("previous_response_id: not available in batch lines")
        job_fields, options = responses_fields(fields)
        options.store = False
        return job_fields, options.to_dict()
    if url == EMBEDDINGS_URL:
        job_fields, encoding = embedding_fields(fields)
        return job_fields, {"encoding_format": encoding}
    return fields, None


def endpoint_body(result: GenerationResult, url: str, options: dict | None) -> dict[str, Any]:
    """The Responses object or embeddings list of a finished job."""
    if url == RESPONSES_URL:
        opts = ResponseOptions(**(options or {}))
        return response_object(result.job_id, opts, result.model or "", result=result)
    body = embedding_body(result, (options or {}).get("encoding_format", "float"))
    return body.model_dump(mode="json")
