"""OpenAI Batch API input lines (plus plain {"prompt": ...} lines): parsing and file checks.

A file OpenAI would refuse at upload (a line that is not JSON or not an object, an OpenAI line
without `custom_id`, another method or url, an unknown top-level field, a repeated
`custom_id`) is refused whole, before any job is queued. A line whose body has bad fields
becomes a 400 error line, as OpenAI answers such a request.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from producer.contract.schema import GenerationRequest
from producer.errors import InvalidRequestError
from producer.openai_endpoints import OTHER_URLS, line_fields
from producer.openai_output import CHAT_URL, COMPLETIONS_URL

__all__ = [
    "CHAT_URL",
    "COMPLETIONS_URL",
    "FileFormatError",
    "FileScan",
    "ParsedLine",
    "parse_line",
    "scan_file",
]

# Body fields of OpenAI requests that mean nothing here: the model is the worker's (use
# `pagedq submit --model` to pin it), a batch never streams, and the rest is bookkeeping.
IGNORED_BODY_FIELDS = ("model", "user", "store", "stream", "stream_options", "service_tier")
MAX_REPORTED_ERRORS = 20


class FileFormatError(ValueError):
    """A line that makes the whole file invalid, as OpenAI's batch upload check would."""


@dataclass(slots=True)
class ParsedLine:
    """One input line: its custom_id, and either a valid request or why its body was refused."""

    line_no: int
    custom_id: str
    url: str
    request: GenerationRequest | None = None
    error: str | None = None
    raw_digest: str = ""
    # How a /v1/responses or /v1/embeddings line's answer is shaped (producer/openai_endpoints).
    options: dict[str, Any] | None = None

    @property
    def top_logprobs(self) -> int | None:
        """The request's `logprobs` top-k (None when no log-probabilities were asked for)."""
        return self.request.logprobs if self.request is not None else None


def parse_line(
    raw: str,
    line_no: int,
    model: str | None = None,
    pinned: dict[str, Any] | None = None,
    defaults: dict[str, Any] | None = None,
) -> ParsedLine:
    """Parse one JSONL line; raises FileFormatError for a line OpenAI would refuse at upload.

    `model` and `pinned` (e.g. {"tenant": "team-a", "priority": 5}) override every line's body;
    `defaults` (e.g. {"response_format": ...}) fill what a body leaves out (a line with its own
    structured_outputs or response_format keeps it).

    A body with bad fields yields a ParsedLine with `error` set (a 400 line in the output).
    """
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise FileFormatError(f"line {line_no}: invalid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise FileFormatError(f"line {line_no}: not a JSON object")
    is_openai = any(k in obj for k in ("body", "url", "method"))
    if "custom_id" in obj:
        if not isinstance(obj["custom_id"], str) or not obj["custom_id"]:
            raise FileFormatError(
                f"line {line_no}: custom_id must be a non-empty str, got {obj['custom_id']!r}"
            )
        custom_id = obj["custom_id"]
    elif is_openai:
        raise FileFormatError(f"line {line_no}: custom_id is required on OpenAI batch lines")
    else:
        custom_id = f"line-{line_no}"
    digest = hashlib.sha256(raw.strip().encode()).hexdigest()
    fields, url = _openai_fields(obj, line_no) if is_openai else _plain_fields(obj)
    try:
        if is_openai:
            fields = _openai_body(fields, url)
        fields, options = line_fields(fields, url)
        fields["custom_id"] = custom_id
        if model is not None:
            fields["model"] = model
        for name, value in (defaults or {}).items():
            if name == "response_format" and "structured_outputs" in fields:
                continue
            fields.setdefault(name, value)
        fields.update(pinned or {})
        request = GenerationRequest.parse(fields)
        return ParsedLine(
            line_no, custom_id, url, request=request, raw_digest=digest, options=options
        )
    except (InvalidRequestError, ValueError) as exc:
        options = None
        error = f"line {line_no}: {exc}"
        return ParsedLine(line_no, custom_id, url, error=error, raw_digest=digest)


def _plain_fields(obj: dict[str, Any]) -> tuple[dict[str, Any], str]:
    fields = dict(obj)
    return fields, CHAT_URL if "messages" in fields else COMPLETIONS_URL


def _openai_fields(obj: dict[str, Any], line_no: int) -> tuple[dict[str, Any], str]:
    extra = set(obj) - {"custom_id", "method", "url", "body"}
    if extra:
        raise FileFormatError(
            f"line {line_no}: unknown top-level field(s) {sorted(extra)}; "
            "allowed: custom_id, method, url, body"
        )
    if obj.get("method", "POST") != "POST":
        raise FileFormatError(f"line {line_no}: method must be POST, got {obj.get('method')!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise FileFormatError(f"line {line_no}: body must be a JSON object, got {body!r:.80}")
    url = obj.get("url", CHAT_URL if "messages" in body else COMPLETIONS_URL)
    if url not in (CHAT_URL, COMPLETIONS_URL, *OTHER_URLS):
        allowed = ", ".join((CHAT_URL, COMPLETIONS_URL, *OTHER_URLS))
        raise FileFormatError(f"line {line_no}: url must be one of {allowed}, got {url!r}")
    return {k: v for k, v in body.items() if k not in IGNORED_BODY_FIELDS}, url


def _openai_body(fields: dict[str, Any], url: str) -> dict[str, Any]:
    if "max_completion_tokens" in fields:
        if "max_tokens" in fields:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        fields["max_tokens"] = fields.pop("max_completion_tokens")
    if url == CHAT_URL and ("logprobs" in fields or "top_logprobs" in fields):
        # Chat asks with a boolean plus a top-k; pagedq takes the top-k alone.
        wanted, top = fields.pop("logprobs", False), fields.pop("top_logprobs", 0)
        if wanted is True:
            fields["logprobs"] = top
    return fields


@dataclass(slots=True)
class FileScan:
    """What a first pass over an input file found: its problems, and each line's output id."""

    lines: int = 0
    errors: list[str] = field(default_factory=list)
    num_errors: int = 0
    # custom_id -> the id its output line must carry (a job id, or "invalid-<digest>").
    line_ids: dict[str, str] = field(default_factory=dict)

    def refuse(self, message: str) -> None:
        """Record a problem (only the first MAX_REPORTED_ERRORS are kept for display)."""
        self.num_errors += 1
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(message)


def scan_file(
    path: str,
    model: str | None,
    line_id: Callable[[ParsedLine], str],
    pinned: dict[str, Any] | None = None,
    defaults: dict[str, Any] | None = None,
) -> FileScan:
    """Check every line of IN without queuing anything; `line_id` names each line's output."""
    scan = FileScan()
    first_line: dict[str, int] = {}
    with open(path, encoding="utf-8") as fin:
        for line_no, raw in enumerate(fin, 1):
            if not raw.strip():
                continue
            scan.lines += 1
            try:
                parsed = parse_line(raw, line_no, model, pinned, defaults)
            except FileFormatError as exc:
                scan.refuse(str(exc))
                continue
            if parsed.custom_id in first_line:
                scan.refuse(
                    f"line {line_no}: duplicate custom_id {parsed.custom_id!r} "
                    f"(first on line {first_line[parsed.custom_id]})"
                )
                continue
            first_line[parsed.custom_id] = line_no
            scan.line_ids[parsed.custom_id] = line_id(parsed)
    return scan


def invalid_line_id(parsed: ParsedLine) -> str:
    """The output id of a line refused for its body: it changes when the line is edited."""
    return f"invalid-{parsed.raw_digest[:24]}"
