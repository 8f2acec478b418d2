"""How a job ends: the result dict, the final stream entry, and the fenced script that writes them.

`JobEnder` only builds `ScriptCall`s (rq_adapter); the control loop runs them, alone or batched
with a step's stream entries, so one EVALSHA ends a job.
"""

from __future__ import annotations

import time
from typing import Any

from producer.keys import result_key
from worker.inflight import InFlight
from worker.jobs import build_result
from worker.rq_adapter import Claim, RQAdapter, ScriptCall


class JobEnder:
    """Builds the result and the ending script of finished, failed, canceled, requeued jobs."""

    def __init__(self, adapter: RQAdapter, model_name: str) -> None:
        self.adapter = adapter
        self.model_name = model_name

    def result(
        self, item: InFlight, output: Any, status: str, error: str | None = None
    ) -> dict[str, Any]:
        """The GenerationResult (as JSON-ready dict) of an in-flight job."""
        end = time.time()
        first = item.first_token_at
        timings = {
            "queued_s": round(item.started_at - item.enqueued_at, 6),
            "ttft_s": round(first - item.enqueued_at, 6) if first else None,
            "total_s": round(end - item.enqueued_at, 6),
        }
        return build_result(
            item.job_id,
            item.request,
            output,
            status=status,
            model=self.model_name,
            worker=self.adapter.name,
            timings=timings,
            error=error,
        ).model_dump(mode="json")

    def finish(self, item: InFlight, output: Any) -> ScriptCall:
        """End a job whose request finished in the engine."""
        result = self.result(item, output, "finished")
        reason = str(output.outputs[0].finish_reason)
        summary = {
            "job_id": item.job_id,
            "status": "finished",
            "finish_reason": result["finish_reason"],
            "usage": result["usage"],
            "result_key": result_key(item.job_id),
        }
        final = {"event": "done", "finish_reason": reason}
        return self.adapter.end_call(
            item.claim, "finished", result, final, summary, stream_ttl_set=item.stream.ttl_set
        )

    def fail(self, item: InFlight, message: str) -> ScriptCall:
        """End a job as failed for good (the error is in the job, not the worker)."""
        result = self.result(item, item.last_output, "failed", error=message)
        final = {"event": "error", "error": message}
        return self.adapter.end_call(item.claim, "failed", result, final)

    def fail_claim(self, claim: Claim, message: str) -> ScriptCall:
        """Fail a job that never reached the engine (malformed hash, bad request)."""
        result = build_result(
            claim.job_id,
            None,
            None,
            status="failed",
            model=self.model_name,
            worker=self.adapter.name,
            timings={},
            error=message,
        ).model_dump(mode="json")
        final = {"event": "error", "error": message}
        return self.adapter.end_call(claim, "failed", result, final)

    def cancel(self, item: InFlight) -> ScriptCall:
        """End a job as canceled (RQ's canceled registry, error=canceled)."""
        result = self.result(item, item.last_output, "canceled", error="canceled")
        final = {"event": "error", "error": "canceled"}
        return self.adapter.end_call(item.claim, "canceled", result, final)

    def requeue(self, item: InFlight, *, count_crash: bool, reason: str) -> ScriptCall:
        """Put a job back at the front of its queue; a crash counts against the job."""
        result = self.result(item, item.last_output, "failed", error=reason)
        return self.adapter.requeue_call(
            item.claim, count_crash=count_crash, result=result, reason=reason
        )
