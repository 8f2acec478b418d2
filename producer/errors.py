"""Exceptions raised by the pagedq producer."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A job's fields were refused; the message names each field, its value and what is allowed."""

    def __init__(self, message: str, errors: list[dict] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or []


class JobFailedError(RuntimeError):
    """A job ended failed; `error` carries the worker's (or RQ's) failure message."""

    def __init__(self, job_id: str, error: str | None, result: object | None = None) -> None:
        super().__init__(f"job {job_id} failed: {error or 'no error message recorded'}")
        self.job_id = job_id
        self.error = error
        self.result = result


class JobCanceledError(RuntimeError):
    """A job was canceled before it finished."""

    def __init__(self, job_id: str, result: object | None = None) -> None:
        super().__init__(f"job {job_id} was canceled")
        self.job_id = job_id
        self.result = result


class JobNotFoundError(KeyError):
    """No job, result or stream exists in Redis under this id (never submitted, or expired)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(job_id)
        self.job_id = job_id

    def __str__(self) -> str:
        return f"no job {self.job_id!r} in Redis (never submitted, or its result expired)"
