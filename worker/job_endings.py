"""How a job ends: the result dict, the final stream entry, and the fenced script that writes them.

`JobEnder` only builds `Ending`s (a `ScriptCall` of rq_adapter plus what it writes); the control
loop runs the calls, alone or batched with a step's stream entries, so one EVALSHA ends a job.
Once the script says the job ended, `JobEnder.record` makes the one metrics observation and the
one log line of that end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from producer.keys import result_key
from worker.engine_loop import own_copy
from worker.inflight import InFlight
from worker.jobs import build_result
from worker.logs import log_job_end
from worker.metrics import WorkerMetrics
from worker.rq_adapter import Claim, RQAdapter, ScriptCall


@dataclass(slots=True)
class Ending:
    """One job end: the fenced script to run, and the result and output it is built from."""

    job_id: str
    status: str
    call: ScriptCall
    result: dict[str, Any]
    output: Any = None
    enqueued_at: float | None = None


class JobEnder:
    """Builds the result and the ending script of finished, failed, canceled, requeued jobs."""

    def __init__(
        self, adapter: RQAdapter, model_name: str, metrics: WorkerMetrics, tokenizer: Any = None
    ) -> None:
        self.adapter = adapter
        self.model_name = model_name
        self.metrics = metrics
        # Decodes token_texts at job end, on the control thread: its own copy of the tokenizer.
        self._tokenizer = own_copy(tokenizer) if tokenizer is not None else None

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
        asked_logprobs = item.request is not None and item.request.logprobs is not None
        decode = self._tokenizer.batch_decode if asked_logprobs and self._tokenizer else None
        return build_result(
            item.job_id,
            item.request,
            output,
            status=status,
            model=self.model_name,
            worker=self.adapter.name,
            timings=timings,
            error=error,
            batch_decode=decode,
        ).model_dump(mode="json")

    def finish(self, item: InFlight, output: Any) -> Ending:
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
        call = self.adapter.end_call(
            item.claim, "finished", result, final, summary, stream_ttl_set=item.stream.ttl_set
        )
        return Ending(item.job_id, "finished", call, result, output, item.enqueued_at)

    def fail(self, item: InFlight, message: str) -> Ending:
        """End a job as failed for good (the error is in the job, not the worker)."""
        result = self.result(item, item.last_output, "failed", error=message)
        final = {"event": "error", "error": message}
        call = self.adapter.end_call(item.claim, "failed", result, final)
        return Ending(item.job_id, "failed", call, result, item.last_output, item.enqueued_at)

    def fail_claim(self, claim: Claim, message: str) -> Ending:
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
        call = self.adapter.end_call(claim, "failed", result, final)
        return Ending(claim.job_id, "failed", call, result)

    def cancel(self, item: InFlight) -> Ending:
        """End a job as canceled (RQ's canceled registry, error=canceled)."""
        result = self.result(item, item.last_output, "canceled", error="canceled")
        final = {"event": "error", "error": "canceled"}
        call = self.adapter.end_call(item.claim, "canceled", result, final)
        return Ending(item.job_id, "canceled", call, result, item.last_output, item.enqueued_at)

    def requeue(self, item: InFlight, *, count_crash: bool, reason: str) -> ScriptCall:
        """Put a job back at the front of its queue; a crash counts against the job."""
        result = self.result(item, item.last_output, "failed", error=reason)
        return self.adapter.requeue_call(
            item.claim, count_crash=count_crash, result=result, reason=reason
        )

    def record(self, ending: Ending) -> None:
        """The one metrics observation and the one log line of an ended job."""
        output, result = ending.output, ending.result
        prompt = generated = reason = queued = None
        if output is not None:
            prompt = len(output.prompt_token_ids or [])
            generated = sum(len(c.token_ids) for c in output.outputs)
            reason = output.outputs[0].finish_reason if output.outputs else None
            scheduled = getattr(getattr(output, "metrics", None), "first_scheduled_time", None)
            if scheduled is not None and ending.enqueued_at is not None:
                queued = scheduled - ending.enqueued_at
        timings = result.get("timings") or {}
        self.metrics.observe_job_end(
            ending.status, reason, prompt, generated, queued, timings.get("total_s")
        )
        log_job_end(
            ending.job_id,
            ending.status,
            finish_reason=reason,
            prompt_tokens=prompt,
            completion_tokens=generated,
            timings=timings,
            error=result.get("error") if ending.status == "failed" else None,
        )
