"""Files in Redis: uploads checked line by line and stored in chunks of whole lines."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from redis import Redis

from gateway.errors import APIError, not_found
from gateway.keys import file_data_key, file_key, files_index_key
from producer.openai_batch import FileFormatError, parse_line

CHUNK_BYTES = 1 << 20
READ_BYTES = 1 << 20
MAX_REPORTED_ERRORS = 10
# An upload still being written expires unless it completes: a killed gateway leaves nothing.
PARTIAL_TTL_S = 3600
PURPOSES = ("batch",)


@dataclass(slots=True)
class Limits:
    """The checks of a batch input file (OpenAI's defaults: 200 MB, 50,000 requests)."""

    max_bytes: int
    max_lines: int


def file_object(fields: dict[str, str]) -> dict[str, Any]:
    """OpenAI's File object from a file's hash."""
    expires = fields.get("expires_at")
    return {
        "id": fields["id"],
        "object": "file",
        "bytes": int(fields["bytes"]),
        "created_at": int(fields["created_at"]),
        "filename": fields["filename"],
        "purpose": fields["purpose"],
        "status": "processed",
        "expires_at": int(expires) if expires else None,
        "status_details": None,
    }


def _decode(raw: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in raw.items()}


class FileStore:
    """Uploads, lists, reads and deletes files of one owner at a time (sync Redis)."""

    def __init__(self, redis: Redis, file_ttl: int, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.redis = redis
        self.file_ttl = file_ttl
        self.chunk_bytes = chunk_bytes

    def upload(
        self, owner: str, filename: str, purpose: str, source: IO[bytes], limits: Limits
    ) -> dict[str, Any]:
        """Check and store an uploaded batch file; APIError 400 (with line numbers) or 413."""
        if purpose not in PURPOSES:
            raise APIError(
                400, f"purpose must be one of {list(PURPOSES)}, got {purpose!r}", param="purpose"
            )
        file_id = "file-" + uuid.uuid4().hex[:24]
        data_key = file_data_key(file_id)
        chunk_lines: list[int] = []
        errors: list[str] = []
        total_bytes, line_no, requests = 0, 0, 0
        try:
            for chunk in _line_chunks(source, self.chunk_bytes):
                total_bytes += len(chunk)
                if total_bytes > limits.max_bytes:
                    raise APIError(
                        413,
                        f"file is over the {limits.max_bytes} bytes a batch file may have",
                        param="file",
                        code="file_too_large",
                    )
                n_lines, n_requests = self._check_lines(chunk, line_no, errors)
                line_no += n_lines
                requests += n_requests
                if requests > limits.max_lines:
                    raise APIError(
                        400,
                        f"file has more than {limits.max_lines} requests (a batch holds at most "
                        f"{limits.max_lines})",
                        param="file",
                        code="too_many_requests",
                    )
                if not errors:
                    pipe = self.redis.pipeline(transaction=False)
                    pipe.rpush(data_key, chunk)
                    pipe.expire(data_key, PARTIAL_TTL_S)
                    pipe.execute()
                    chunk_lines.append(n_lines)
            if errors:
                raise APIError(
                    400,
                    f"invalid batch file {filename!r}: " + "; ".join(errors[:MAX_REPORTED_ERRORS]),
                    param="file",
                    code="invalid_file_format",
                )
            if requests == 0:
                raise APIError(400, "the file holds no request", param="file", code="empty_file")
        except BaseException:
            self.redis.delete(data_key)
            raise
        now = int(time.time())
        fields = {
            "id": file_id,
            "bytes": total_bytes,
            "created_at": now,
            "filename": filename,
            "purpose": purpose,
            "owner": owner,
            "kind": "upload",
            "lines": line_no,
            "requests": requests,
            "chunk_lines": json.dumps(chunk_lines),
            "expires_at": now + self.file_ttl,
        }
        pipe = self.redis.pipeline()
        pipe.hset(file_key(file_id), mapping=fields)
        pipe.expire(file_key(file_id), self.file_ttl)
        pipe.expire(data_key, self.file_ttl)
        pipe.zadd(files_index_key(owner), {file_id: time.time_ns() // 1000})
        pipe.execute()
        return file_object(_decode({k.encode(): str(v).encode() for k, v in fields.items()}))

    @staticmethod
    def _check_lines(chunk: bytes, first_line: int, errors: list[str]) -> tuple[int, int]:
        """Lines and requests in a chunk; format errors (as OpenAI refuses them) to `errors`."""
        lines = chunk.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        requests = 0
        for i, raw in enumerate(lines, first_line + 1):
            if not raw.strip():
                continue
            requests += 1
            if len(errors) >= MAX_REPORTED_ERRORS:
                continue
            try:
                parse_line(raw.decode("utf-8"), i)
            except UnicodeDecodeError:
                errors.append(f"line {i}: not UTF-8")
            except FileFormatError as exc:
                errors.append(str(exc))
        return len(lines), requests

    def fields(self, owner: str, file_id: str) -> dict[str, str]:
        """A file's hash; 404 when absent or another owner's."""
        fields = _decode(self.redis.hgetall(file_key(file_id)))
        if not fields or fields.get("owner") != owner or fields.get("deleted"):
            raise not_found("file", file_id)
        return fields

    def get(self, owner: str, file_id: str) -> dict[str, Any]:
        """The File object."""
        return file_object(self.fields(owner, file_id))

    def list(
        self, owner: str, after: str | None, limit: int, order: str, purpose: str | None
    ) -> dict[str, Any]:
        """A page of the owner's files, OpenAI's list shape with has_more."""
        ids = self.redis.zrange(files_index_key(owner), 0, -1)
        ids = [i.decode() for i in ids]
        if order == "desc":
            ids.reverse()
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        data, gone = [], []
        for file_id in ids:
            fields = _decode(self.redis.hgetall(file_key(file_id)))
            if not fields or fields.get("deleted"):
                gone.append(file_id)
                continue
            if purpose is not None and fields.get("purpose") != purpose:
                continue
            data.append(file_object(fields))
            if len(data) > limit:
                break
        if gone:
            self.redis.zrem(files_index_key(owner), *gone)
        first = data[0]["id"] if data else None
        last = data[min(len(data), limit) - 1]["id"] if data else None
        return {
            "object": "list",
            "data": data[:limit],
            "first_id": first,
            "last_id": last,
            "has_more": len(data) > limit,
        }

    def delete(self, owner: str, file_id: str) -> dict[str, Any]:
        """Delete a file (its chunks too); OpenAI's FileDeleted object."""
        fields = self.fields(owner, file_id)
        pipe = self.redis.pipeline()
        if int(fields.get("batch_refs", 0)):
            # Its batches still read it (to enqueue, and to write their output): hidden only,
            # it goes when its TTL ends.
            pipe.hset(file_key(file_id), "deleted", "1")
        else:
            pipe.delete(file_key(file_id), file_data_key(file_id))
        pipe.zrem(files_index_key(owner), file_id)
        pipe.execute()
        return {"id": file_id, "object": "file", "deleted": True}

    def chunks(self, file_id: str, start: int = 0) -> Iterator[bytes]:
        """An uploaded file's chunks from chunk `start` on, one Redis read each."""
        i = start
        while True:
            chunk = self.redis.lindex(file_data_key(file_id), i)
            if chunk is None:
                return
            yield chunk
            i += 1


def chunk_lines(chunk: bytes, first_line: int) -> Iterator[tuple[int, str]]:
    """The non-blank lines of a chunk with their 1-based line numbers."""
    lines = chunk.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for i, raw in enumerate(lines, first_line + 1):
        if raw.strip():
            yield i, raw.decode("utf-8")


def _line_chunks(source: IO[bytes], chunk_bytes: int) -> Iterator[bytes]:
    """The source's bytes cut into chunks of whole lines, each about `chunk_bytes`."""
    pending = b""
    while block := source.read(min(READ_BYTES, chunk_bytes)):
        pending += block
        cut = pending.rfind(b"\n")
        if len(pending) >= chunk_bytes and cut >= 0:
            yield pending[: cut + 1]
            pending = pending[cut + 1 :]
    if pending:
        yield pending
