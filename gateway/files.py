"""/v1/files: upload (multipart, checked as OpenAI checks a batch file), list, retrieve,
content (streamed out), delete."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import StreamingResponse

from gateway.auth import TenantDep
from gateway.batch_lines import BatchLines
from gateway.batch_output import output_lines
from gateway.errors import APIError
from gateway.file_store import Limits

router = APIRouter()


@router.post("/v1/files")
def create_file(
    request: Request,
    file: Annotated[UploadFile, File()],
    purpose: Annotated[str, Form()],
    tenant: TenantDep,
) -> dict[str, Any]:
    """Upload a batch input file; 400 names the bad lines, 413 when it is too large."""
    config = request.app.state.config
    limits = Limits(config.max_file_bytes, config.max_file_lines)
    name = file.filename or "upload.jsonl"
    return request.app.state.files.upload(tenant.owner, name, purpose, file.file, limits)


@router.get("/v1/files")
def list_files(
    request: Request,
    tenant: TenantDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    purpose: str | None = None,
) -> dict[str, Any]:
    """The key's files, newest first by default."""
    return request.app.state.files.list(tenant.owner, after, limit, order, purpose)


@router.get("/v1/files/{file_id}")
def retrieve_file(request: Request, file_id: str, tenant: TenantDep) -> dict[str, Any]:
    """One file object."""
    return request.app.state.files.get(tenant.owner, file_id)


@router.delete("/v1/files/{file_id}")
def delete_file(request: Request, file_id: str, tenant: TenantDep) -> dict[str, Any]:
    """Delete a file."""
    return request.app.state.files.delete(tenant.owner, file_id)


@router.get("/v1/files/{file_id}/content")
def file_content(request: Request, file_id: str, tenant: TenantDep) -> StreamingResponse:
    """The file's bytes, streamed: an upload's chunks, or a batch's output made from results."""
    state = request.app.state
    fields = state.files.fields(tenant.owner, file_id)
    if fields.get("kind") == "upload":
        body: Iterator[bytes] = state.files.chunks(file_id)
    else:
        batch = state.batches.fields(fields.get("batch_id", ""))
        if not batch:
            raise APIError(404, f"the batch of file {file_id} is gone", code="not_found")
        lines = BatchLines.of(state.files, batch)
        want_errors = fields["kind"] == "error"
        config = state.config
        parsers = (config.tool_call_parser, config.reasoning_parser)
        made = output_lines(lines, batch.get("stop", ""), int(batch["created_at"]), parsers=parsers)
        body = (line for is_error, line in made if is_error == want_errors)
    headers = {"Content-Disposition": f'attachment; filename="{fields["filename"]}"'}
    return StreamingResponse(body, media_type="application/jsonl", headers=headers)
