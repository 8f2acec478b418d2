"""OpenAI's embeddings request and response, as a pagedq embedding job and its result.

Shared by the gateway's `/v1/embeddings` and by `/v1/embeddings` batch lines (gateway batches
and `pagedq submit`). Honoured: `input` (a string, strings, token ids, lists of token ids),
`encoding_format` ("float" or "base64": little-endian float32, as OpenAI sends it),
`dimensions` (the first N of the vector, normalised again; at most the hidden size),
`model`; `user` is accepted and changes nothing. Any other field is refused by name.
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from pydantic import BaseModel

from producer.contract.embeddings import EMBED_TASK
from producer.contract.schema import GenerationResult

EMBEDDINGS_URL = "/v1/embeddings"
ENCODING_FORMATS = ("float", "base64")
ALLOWED_FIELDS = ("input", "model", "encoding_format", "dimensions", "user")


class EmbeddingFieldError(ValueError):
    """A refused body field; `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class Embedding(BaseModel):
    """One input's vector (a float list, or its float32 bytes in base64)."""

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    """Prompt tokens over every input (embeddings have no completion tokens)."""

    prompt_tokens: int
    total_tokens: int


class CreateEmbeddingResponse(BaseModel):
    """The body of a finished /v1/embeddings request."""

    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def embedding_fields(body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The job fields of an embeddings body, and its encoding_format; EmbeddingFieldError names
    a refused field. `model` is left to the caller (routing)."""
    unknown = [k for k, v in body.items() if k not in ALLOWED_FIELDS and v is not None]
    if unknown:
        raise EmbeddingFieldError(
            f"unknown field {unknown[0]!r} for embeddings (allowed: {', '.join(ALLOWED_FIELDS)})",
            unknown[0],
        )
    if "input" not in body or body["input"] is None:
        raise EmbeddingFieldError("input is required", "input")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ENCODING_FORMATS:
        raise EmbeddingFieldError(
            f"encoding_format must be one of {ENCODING_FORMATS}, got {encoding!r:.80}",
            "encoding_format",
        )
    fields: dict[str, Any] = {"task": EMBED_TASK, "input": _inputs(body["input"])}
    dimensions = body.get("dimensions")
    if dimensions is not None:
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
            raise EmbeddingFieldError(
                f"dimensions must be an integer >= 1, got {dimensions!r:.80}", "dimensions"
            )
        fields["dimensions"] = dimensions
    # An embedding computes no new token: it costs its prompt only in the fair queue.
    fields["max_tokens"] = 1
    return fields, encoding


def _inputs(value: Any) -> list[Any]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return [value]  # one token-id list
        return value
    raise EmbeddingFieldError(
        "input must be a string, a list of strings, a list of token ids or a list of such lists",
        "input",
    )


def encode_vector(vector: list[float], encoding: str) -> list[float] | str:
    """The vector as OpenAI sends it: floats, or base64 of little-endian float32."""
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


def embedding_body(
    result: GenerationResult, encoding: str = "float", model: str | None = None
) -> CreateEmbeddingResponse:
    """The CreateEmbeddingResponse of a finished embedding job."""
    data = [
        Embedding(index=i, embedding=encode_vector(vector, encoding))
        for i, vector in enumerate(result.embeddings or [])
    ]
    tokens = result.usage.prompt_tokens
    return CreateEmbeddingResponse(
        data=data,
        model=model or result.model or "",
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
