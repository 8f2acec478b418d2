"""Bearer API keys: each key acts for one tenant; keys are compared in constant time and never
logged."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from gateway.config import Tenant
from gateway.errors import APIError


def tenant_for(request: Request) -> Tenant:
    """The tenant of the request's `Authorization: Bearer KEY` (FastAPI dependency).

    With no keys configured every request is the anonymous tenant (the gateway then listens on
    loopback only). A missing or unknown key is 401, as OpenAI answers.
    """
    config = request.app.state.config
    keys: dict[str, Tenant] = config.api_keys
    if not keys:
        return Tenant(batch_priority=config.batch_priority)
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise APIError(
            401,
            "You didn't provide an API key. Provide it as 'Authorization: Bearer YOUR_KEY'.",
            code="missing_api_key",
        )
    key = key.strip()
    found = None
    for known, tenant in keys.items():
        if hmac.compare_digest(known.encode(), key.encode()):
            found = tenant
    if found is None:
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
    return found


TenantDep = Annotated[Tenant, Depends(tenant_for)]
"""The tenant of a request, as an endpoint parameter."""
