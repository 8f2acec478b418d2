"""Reading an RQ job's `data` field safely: bounded zlib inflation, then JSON only."""

from __future__ import annotations

import json
import zlib
from typing import Any

# JSON text of an array starts with "[" or whitespace; none of those bytes can open a zlib
# stream (its first byte must say "deflate", low nibble 8), so such data is never inflated twice.
_JSON_ARRAY_START = b"[ \t\r\n"


class PayloadTooLargeError(ValueError):
    """A job's data inflates past the allowed size."""


def inflate(raw: bytes, max_bytes: int) -> bytes:
    """RQ's `data` (zlib-compressed, or plain JSON as other producers write it), at most
    `max_bytes` once inflated; a zlib bomb stops after `max_bytes + 1` bytes.

    Like RQ's `Job.restore`, bytes that are not a complete zlib stream are taken as they are.
    """
    inflater = zlib.decompressobj()
    try:
        data = inflater.decompress(raw, max_bytes + 1)
    except zlib.error:
        data = None
    if data is not None and len(data) > max_bytes:
        raise PayloadTooLargeError(
            f"job data inflates to more than max_payload_bytes={max_bytes} bytes"
        )
    if data is None or not inflater.eof:
        data = raw
    if len(data) > max_bytes:
        raise PayloadTooLargeError(
            f"job data is {len(data)} bytes: must be at most max_payload_bytes={max_bytes}"
        )
    return data


def is_plain_json_array(data: bytes) -> bool:
    """True when `data` starts like a JSON array (and so can never be read as zlib)."""
    return data[:1] != b"" and data[:1] in _JSON_ARRAY_START


def load_job_data(raw: bytes, max_bytes: int) -> tuple[Any, Any, Any, Any]:
    """(func_name, instance, args, kwargs) of a job's `data`; ValueError says what is wrong."""
    data = inflate(raw, max_bytes)
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        raise ValueError(
            "job data is not valid JSON; pagedq reads JSON-serialized jobs only"
        ) from None
    if not isinstance(value, list) or len(value) != 4:
        raise ValueError(
            "job data must be a JSON array [func_name, null, args, kwargs], "
            f"got {type(value).__name__}"
        )
    return value[0], value[1], value[2], value[3]
