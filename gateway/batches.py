"""/v1/batches: create, retrieve, list, cancel (the work is done by every gateway's runner)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request

from gateway.auth import TenantDep
from gateway.errors import APIError

router = APIRouter()


@router.post("/v1/batches")
def create_batch(
    request: Request, body: Annotated[Any, Body()], tenant: TenantDep
) -> dict[str, Any]:
    """A new batch over an uploaded file (status `validating`)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return request.app.state.batches.create(tenant, body)


@router.get("/v1/batches")
def list_batches(
    request: Request,
    tenant: TenantDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> dict[str, Any]:
    """The key's batches, newest first."""
    return request.app.state.batches.list(tenant.owner, after, limit)


@router.get("/v1/batches/{batch_id}")
def retrieve_batch(request: Request, batch_id: str, tenant: TenantDep) -> dict[str, Any]:
    """One batch, with exact request_counts."""
    return request.app.state.batches.get(tenant.owner, batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
def cancel_batch(request: Request, batch_id: str, tenant: TenantDep) -> dict[str, Any]:
    """Cancel a batch: `cancelling` now, `cancelled` once its running lines stopped."""
    return request.app.state.batches.cancel(tenant.owner, batch_id)
