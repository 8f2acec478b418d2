"""OpenAI's error envelope {"error": {message, type, param, code}} for every failure."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

from producer.errors import ReplicaAckError

log = logging.getLogger("pagedq.gateway")

TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


class APIError(Exception):
    """An HTTP error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or TYPES.get(status, "server_error")
        self.headers: dict[str, str] = {}


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object, as a JSON-ready dict."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    """The JSON response of an APIError."""
    body = error_body(exc.message, exc.type, exc.param, exc.code)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers or None)


def not_found(what: str, ident: str) -> APIError:
    """404 for an object this key cannot see (absent, expired or another tenant's)."""
    return APIError(404, f"No {what} found with id '{ident}'.", param="id", code="not_found")


def install(app: FastAPI) -> None:
    """Route every error, FastAPI's and Starlette's own included, through OpenAI's envelope."""

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p not in ('body', 'query', 'path'))}"
            f": {e.get('msg')}"
            for e in errors
        )
        return error_response(APIError(400, message or "invalid request", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return error_response(APIError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    async def _redis_down(_: Request, exc: Exception) -> JSONResponse:
        log.warning("Redis unreachable: %s", type(exc).__name__)
        response = error_response(
            APIError(503, "the queue's Redis is unreachable; retry later", code="redis_unavailable")
        )
        response.headers["Retry-After"] = "5"
        return response

    @app.exception_handler(ReplicaAckError)
    async def _replicas_behind(_: Request, exc: ReplicaAckError) -> JSONResponse:
        log.warning("enqueue not acknowledged by enough replicas: %s", exc)
        response = error_response(
            APIError(
                503,
                f"the queue's Redis replicas did not acknowledge the request in time "
                f"({exc.acked} of {exc.wanted} within {exc.timeout_ms} ms); retry later",
                code="replica_ack_timeout",
            )
        )
        response.headers["Retry-After"] = "5"
        return response
