"""A batch's input lines, read back from its file in Redis, as requests with their job ids.

The same parse gives the same job ids whenever a line is read (to enqueue it, cancel it or
write its output), so no gateway needs to remember which job answers which line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gateway.file_store import FileStore, chunk_lines
from gateway.keys import file_key
from producer.connection import is_cluster
from producer.contract.shards import QueueShards
from producer.enqueue import request_job_id
from producer.openai_batch import FileFormatError, ParsedLine, parse_line


@dataclass(slots=True)
class BatchLines:
    """How one batch reads its input file: queue, job-id namespace and pinned fields."""

    files: FileStore
    file_id: str
    batch_id: str
    queue: str
    pinned: dict[str, Any]
    shards: QueueShards | None = None

    @classmethod
    def of(cls, files: FileStore, fields: dict[str, str]) -> BatchLines:
        """The lines of the batch whose hash is `fields` (its queue names its jobs)."""
        pinned: dict[str, Any] = {"priority": int(fields["priority"])}
        if fields.get("tenant"):
            pinned["tenant"] = fields["tenant"]
        shards = QueueShards(
            fields["queue"],
            int(fields.get("queue_shards") or 1),
            tagged=is_cluster(files.redis),
        )
        return cls(files, fields["input_file_id"], fields["id"], fields["queue"], pinned, shards)

    def chunk_starts(self) -> list[int]:
        """The line number before the first line of each chunk."""
        counts = json.loads(self.files.redis.hget(file_key(self.file_id), "chunk_lines") or "[]")
        starts, n = [], 0
        for count in counts:
            starts.append(n)
            n += count
        return starts

    def parse(self, raw: str, line_no: int) -> ParsedLine:
        """One line as a request (or a 400 error); FileFormatError for a refused line."""
        return parse_line(raw, line_no, None, self.pinned)

    def job_id(self, parsed: ParsedLine) -> str | None:
        """The job of a valid line (None for a line refused for its body)."""
        if parsed.request is None:
            return None
        return request_job_id(parsed.request, self.queue, self.batch_id, shards=self.shards)

    def chunks(self, start: int = 0, stop: int | None = None) -> Iterator[list[ParsedLine]]:
        """The parsed lines of chunks [start, stop), one list per chunk."""
        starts = self.chunk_starts()
        stop = len(starts) if stop is None else stop
        for index, chunk in enumerate(self.files.chunks(self.file_id, start), start):
            if index >= stop:
                return
            yield [self.parse(raw, no) for no, raw in chunk_lines(chunk, starts[index])]


__all__ = ["BatchLines", "FileFormatError", "ParsedLine"]
