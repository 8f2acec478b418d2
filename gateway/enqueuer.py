"""Online requests enqueued together: whatever arrived while the last round trip ran goes in
the next one (one thread hop and one Redis pipeline for a burst, not one per request)."""

from __future__ import annotations

import asyncio
from functools import partial

import anyio

from producer.client import Client
from producer.contract.schema import GenerationRequest

MAX_BATCH = 256


class Enqueuer:
    """Enqueues requests through `Client.enqueue`, coalescing concurrent ones; with `wake` (the
    gateway's StreamHub's wake id) the workers tell that hub when the jobs' streams get
    entries."""

    def __init__(self, client: Client, wake: str | None = None) -> None:
        self.client = client
        self.wake = wake
        self._pending: list[tuple[GenerationRequest, asyncio.Future]] = []
        self._running = False

    async def submit(self, request: GenerationRequest) -> str:
        """Enqueue one request; returns its job id once Redis has it."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        if not self._running:
            self._running = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
                requests = [r for r, _ in batch]
                try:
                    job_ids = await anyio.to_thread.run_sync(
                        partial(self.client.enqueue, requests, wake=self.wake)
                    )
                except Exception as exc:  # every waiting request gets the error (e.g. 503)
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for (_, future), job_id in zip(batch, job_ids):
                    if not future.done():
                        future.set_result(job_id)
        finally:
            self._running = False
