"""A batch's output and error files, written from its jobs' results whenever they are read.

Nothing is copied: each line is made from the input line and `pagedq:result:{job_id}`, so every
gateway writes the same bytes (`created` is the batch's created_at, lines come in input order).
Finished lines go to the output file; refused (400), failed (500), canceled and expired lines
to the error file, as OpenAI splits them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from pydantic import ValidationError

from gateway.batch_lines import BatchLines
from producer.connection import mget
from producer.contract.keys import result_key
from producer.contract.schema import GenerationResult
from producer.openai_batch import ParsedLine, invalid_line_id
from producer.openai_output import (
    BatchError,
    BatchOutputLine,
    ChatCompletion,
    Completion,
    invalid_request_line,
    result_line,
)
from producer.results import MAX_READ_BYTES

# What a line that never ended says, by how its batch stopped.
STOP_CODES = {"cancelled": "batch_cancelled", "expired": "batch_expired"}


def output_lines(
    lines: BatchLines,
    stop: str,
    created: int,
    num_chunks: int | None = None,
    tick: Callable[[], None] | None = None,
) -> Iterator[tuple[bool, bytes]]:
    """(is_error, JSON line) for every line of the batch's first `num_chunks` chunks."""
    redis = lines.files.redis
    for chunk in lines.chunks(0, num_chunks):
        job_ids = [lines.job_id(p) for p in chunk]
        keys = [result_key(j) for j in job_ids if j is not None]
        raws = iter(mget(redis, keys))
        for parsed, job_id in zip(chunk, job_ids):
            raw = next(raws) if job_id is not None else None
            line = _line(parsed, job_id, raw, stop, created)
            is_error = line.response is None or line.response.status_code != 200
            yield is_error, (line.model_dump_json() + "\n").encode()
        if tick is not None:
            tick()


def _line(
    parsed: ParsedLine, job_id: str | None, raw: bytes | None, stop: str, created: int
) -> BatchOutputLine:
    if parsed.request is None or job_id is None:
        line_id = invalid_line_id(parsed)
        return invalid_request_line(line_id, parsed.custom_id, parsed.error or "invalid request")
    result = _result(job_id, raw)
    if result is None or (result.status == "canceled" and stop in STOP_CODES):
        code = STOP_CODES.get(stop, "result_expired")
        message = {
            "batch_cancelled": "the batch was cancelled before this request ended",
            "batch_expired": "the batch expired before this request ended",
        }.get(code, "the request's result is no longer stored")
        error = BatchError(code=code, message=message)
        return BatchOutputLine(
            id=f"batch_req_{job_id}", custom_id=parsed.custom_id, response=None, error=error
        )
    line = result_line(
        parsed.custom_id, parsed.url, result, parsed.top_logprobs, options=parsed.options
    )
    if line.response is not None and isinstance(line.response.body, ChatCompletion | Completion):
        line.response.body.created = created
    elif line.response is not None and isinstance(line.response.body, dict):
        if "created_at" in line.response.body:  # a Responses object: the same bytes each time
            line.response.body["created_at"] = created
    return line


def _result(job_id: str, raw: bytes | None) -> GenerationResult | None:
    if raw is None:
        return None
    if len(raw) > MAX_READ_BYTES:
        return GenerationResult(job_id=job_id, status="failed", error="result too large")
    try:
        return GenerationResult.model_validate_json(raw)
    except ValidationError:
        return GenerationResult(job_id=job_id, status="failed", error="unreadable result")
