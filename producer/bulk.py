"""`pagedq submit IN.jsonl -o OUT.jsonl`: bulk generation, streamed, resumable, one line per job."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from redis import ConnectionError as RedisConnectionError
from tqdm import tqdm

from producer.client import Client
from producer.errors import JobNotFoundError
from producer.follow import StreamFollower
from producer.openai_batch import ParsedLine, error_line, parse_line, result_line
from producer.results import final_result, is_final

REDIS_DOWN_GRACE_S = 60.0


@dataclass(slots=True)
class BulkSummary:
    """Counts of one `submit` run (`skipped` = already in OUT from an earlier run)."""

    total_lines: int = 0
    skipped: int = 0
    submitted: int = 0
    finished: int = 0
    failed: int = 0
    invalid: int = 0
    duplicates: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    elapsed_s: float = 0.0


def default_batch_id(in_path: str) -> str:
    """The job-id namespace of an input file: its absolute path (custom_ids are per file)."""
    return "file:" + hashlib.sha256(os.path.realpath(in_path).encode()).hexdigest()[:16]


def count_lines(path: str) -> int:
    """Number of lines, read in blocks (never the whole file in memory)."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")


def load_done(out_path: str) -> set[str]:
    """custom_ids already written to OUT; a torn last line (killed mid-write) is cut off."""
    done: set[str] = set()
    if not os.path.exists(out_path):
        return done
    with open(out_path, "rb+") as f:
        good_end = 0
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            good_end += len(raw)
            try:
                done.add(json.loads(raw)["custom_id"])
            except (ValueError, KeyError, TypeError):
                continue
        f.truncate(good_end)
    return done


class BulkRun:
    """One pass over IN: submits in pipelined chunks within a window, writes results to OUT."""

    def __init__(
        self,
        client: Client,
        in_path: str,
        out_path: str,
        *,
        window: int = 1024,
        chunk_size: int = 256,
        model: str | None = None,
        batch_id: str | None = None,
        progress: bool = True,
    ) -> None:
        self.client = client
        self.in_path, self.out_path = in_path, out_path
        self.window, self.chunk_size, self.model = window, max(1, chunk_size), model
        self.batch_id = batch_id or default_batch_id(in_path)
        self.progress = progress
        self.summary = BulkSummary()
        self.in_flight: dict[str, ParsedLine] = {}
        self.follower = StreamFollower(client.redis, check_interval=client.check_interval)
        self._done_at_start: set[str] = set()
        self._seen: set[str] = set()
        self._pending: list[ParsedLine] = []

    def run(self) -> BulkSummary:
        """Process the whole file; safe to interrupt and run again (see run_bulk)."""
        start = time.monotonic()
        self._done_at_start = load_done(self.out_path)
        self.summary.total_lines = count_lines(self.in_path)
        initial = min(len(self._done_at_start), self.summary.total_lines)
        with (
            open(self.in_path, encoding="utf-8") as fin,
            open(self.out_path, "a", encoding="utf-8") as self._out,
            tqdm(
                total=self.summary.total_lines,
                initial=initial,
                unit="line",
                disable=not self.progress,
                dynamic_ncols=True,
            ) as self._bar,
        ):
            lines = enumerate(fin, 1)
            exhausted = False
            down_since: float | None = None
            while not exhausted or self.in_flight or self._pending:
                try:
                    self._enqueue_pending()
                    while not exhausted and len(self.in_flight) < self.window:
                        exhausted = self._submit_chunk(lines)
                    self._collect(block_s=1.0)
                    down_since = None
                except RedisConnectionError:
                    # Ride out a Redis restart: jobs it lost come back as not found, and are
                    # submitted again.
                    down_since = down_since or time.monotonic()
                    if time.monotonic() - down_since > REDIS_DOWN_GRACE_S:
                        raise
                    time.sleep(1.0)
                self.summary.elapsed_s = time.monotonic() - start
                self._show_rate()
        return self.summary

    def _submit_chunk(self, lines: Iterator[tuple[int, str]]) -> bool:
        """Read lines until a chunk is full and enqueue it; True once IN is exhausted."""
        room = min(self.chunk_size, self.window - len(self.in_flight))
        exhausted = True
        for line_no, raw in lines:
            if raw.strip():
                self._take_line(parse_line(raw, line_no, self.model))
            else:
                self._bar.update(1)
            if len(self._pending) >= room:
                exhausted = False
                break
        self._enqueue_pending()
        return exhausted

    def _take_line(self, parsed: ParsedLine) -> None:
        if parsed.custom_id in self._done_at_start:
            self.summary.skipped += 1
            return
        if parsed.custom_id in self._seen:
            self.summary.duplicates.append(parsed.custom_id)
            self._bar.update(1)
            return
        self._seen.add(parsed.custom_id)
        if parsed.error is not None:
            self.summary.invalid += 1
            self._write(error_line(parsed))
        else:
            self._pending.append(parsed)

    def _enqueue_pending(self) -> None:
        # Lines stay pending until Redis took them, so a connection error loses none.
        if not self._pending:
            return
        requests = [p.request for p in self._pending if p.request is not None]
        job_ids = self.client.enqueue(requests, id_namespace=self.batch_id)
        for job_id, parsed in zip(job_ids, self._pending, strict=True):
            self.in_flight[job_id] = parsed
            self.follower.add(job_id)
        self.summary.submitted += len(self._pending)
        self._pending = []

    def _collect(self, block_s: float) -> None:
        for job_id, entry in self.follower.read(block_s):
            if not is_final(entry) or job_id not in self.in_flight:
                continue
            parsed = self.in_flight.pop(job_id)
            try:
                result = final_result(self.client.redis, job_id, entry)
            except JobNotFoundError:
                self._pending.append(parsed)  # lost with a Redis restart: submit it again
                continue
            if result.status == "finished":
                self.summary.finished += 1
                self.summary.completion_tokens += result.usage.completion_tokens
            else:
                self.summary.failed += 1
            self._write(result_line(parsed.custom_id, parsed.url, result))

    def _write(self, line: dict[str, Any]) -> None:
        out: IO[str] = self._out
        out.write(json.dumps(line, ensure_ascii=False) + "\n")
        out.flush()
        self._bar.update(1)

    def _show_rate(self) -> None:
        tok_s = self.summary.completion_tokens / max(self.summary.elapsed_s, 1e-9)
        self._bar.set_postfix(
            {
                "tok/s": f"{tok_s:.1f}",
                "in_flight": len(self.in_flight),
                "failed": self.summary.failed + self.summary.invalid,
            },
            refresh=False,
        )


def run_bulk(client: Client, in_path: str, out_path: str, **options: Any) -> BulkSummary:
    """Run `pagedq submit IN -o OUT` (options: window, chunk_size, model, batch_id, progress).

    OUT gets one OpenAI batch output line per input line (an error line for a bad one), written
    as jobs end. Run again after an interruption, it skips custom_ids already in OUT and reuses
    jobs still queued or finished in Redis (job ids derive from batch_id and custom_id), so no
    job is computed twice and no line is lost.
    """
    return BulkRun(client, in_path, out_path, **options).run()
