"""Every way a job ends: finished, failed, canceled, or requeued. Its result is built once, as a
typed `GenerationResult`, serialized once, and written by one fenced script (with the tokens the
tenant is charged passed beside it, so the script never parses the result).

`finish` returns its `Ending` for the control loop to batch with a step's stream entries; the
other endings run at once through the Redis link. Once the script says the job ended, `record`
makes the one metrics observation and the one log line of that end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import structlog

from producer.contract.keys import result_key
from producer.contract.schema import Choice, GenerationRequest, GenerationResult, Timings, Usage
from producer.contract.stream import (
    done_entry,
    error_entry,
    is_inline,
)
from worker.claim import Claim
from worker.inflight import InFlight
from worker.logs import log_job_end
from worker.metrics import WorkerMetrics
from worker.redis_link import Call, Command, RedisLink, ScriptCall
from worker.rq_adapter import RQAdapter

log = structlog.get_logger("pagedq.worker")


@dataclass(slots=True)
class Ending:
    """One job end: the fenced script to run, and the result and output it is built from."""

    job_id: str
    status: str
    call: ScriptCall
    result: GenerationResult
    output: Any = None
    enqueued_at: float | None = None
    claim: Claim | None = None
    staged: Command | None = None
    """The SET of the result, to run before `call` in the same batch (RQAdapter.stage_result)."""
    entries: list = field(default_factory=list)
    """The job's entries not written yet that the caller writes with a STREAM call before `call`
    (its last tokens; a job of an inline hub has them in `call` itself)."""


@dataclass(slots=True)
class StepWrite:
    """A step's writes, for one batch (`calls`), and how to read their replies (`read`)."""

    calls: list[Call]
    entries: bool
    ends: bool
    fused: bool

    def read(self, replies: list[Any]) -> tuple[Any, list[Any]]:
        """The STREAM reply (None without entries) and the END replies, one per ending."""
        if self.fused:
            streamed, ended = replies[-1]
            return streamed, ended
        return (replies[0] if self.entries else None), (replies[-1] if self.ends else [])


def step_write(adapter: RQAdapter, entries: list, ends: list[Ending]) -> StepWrite:
    """A step's writes: the results its endings staged, then its stream entries and endings in
    one STEP call (one shard), or one STREAM call and one END call (merged)."""
    staged: list[Call] = [ending.staged for ending in ends if ending.staged is not None]
    stream = adapter.stream_call(entries) if entries else None
    end = adapter.merge_ends([ending.call for ending in ends])
    if stream is not None and (step := adapter.step_call(stream, end)) is not None:
        return StepWrite([*staged, step], True, True, True)
    calls = [stream] if stream is not None else []
    return StepWrite([*calls, *staged, *end], bool(entries), bool(ends), False)


def build_result(
    job_id: str,
    request: GenerationRequest | None,
    output: Any | None,
    *,
    status: str,
    model: str,
    worker: str,
    timings: Timings,
    error: str | None = None,
    batch_decode: Any = None,
) -> GenerationResult:
    """The GenerationResult of a job from its last RequestOutput (None if it never ran).

    With `batch_decode` (a tokenizer's), each choice with logprobs gets `token_texts`.
    An embedding job's output gives `embeddings` and its prompt tokens.
    """
    if output is not None and hasattr(output, "num_prompt_tokens"):
        return GenerationResult(
            job_id=job_id,
            custom_id=request.custom_id if request else None,
            status=status,
            finish_reason="stop" if status == "finished" else None,
            embeddings=[o.embedding for o in output.outputs],
            usage=Usage(prompt_tokens=output.num_prompt_tokens),
            timings=timings,
            model=model,
            worker=worker,
            error=error,
            metadata=request.metadata if request else None,
        )
    completions = list(output.outputs) if output is not None else []
    choices = [
        Choice(
            index=c.index,
            text=c.text,
            token_ids=list(c.token_ids),
            finish_reason=c.finish_reason,
            logprobs=c.logprobs,
            token_texts=token_texts(c.logprobs, batch_decode) if batch_decode else None,
        )
        for c in completions
    ]
    first = choices[0] if choices else Choice()
    prompt_ids = getattr(output, "prompt_token_ids", None) or []
    return GenerationResult(
        job_id=job_id,
        custom_id=request.custom_id if request else None,
        status=status,
        text=first.text,
        token_ids=first.token_ids,
        finish_reason=first.finish_reason,
        logprobs=first.logprobs,
        token_texts=first.token_texts,
        choices=choices if len(choices) > 1 else [],
        usage=Usage(
            prompt_tokens=len(prompt_ids),
            completion_tokens=sum(len(c.token_ids) for c in choices),
            forced_tokens=sum(getattr(c, "num_forced_tokens", 0) for c in completions),
        ),
        timings=timings,
        model=model,
        worker=worker,
        error=error,
        metadata=request.metadata if request else None,
    )


def token_texts(logprobs: list[dict[int, float]] | None, decode: Any) -> dict[int, str] | None:
    """The text of every token id in `logprobs` (`decode([id])` each, in one batch call);
    None without logprobs. `decode` is a tokenizer's `batch_decode`."""
    if logprobs is None:
        return None
    ids = sorted({int(t) for entry in logprobs for t in entry})
    return dict(zip(ids, decode([[t] for t in ids]), strict=True))


def _final(item: InFlight, entry: dict[str, str]) -> dict[str, str]:
    """The stream's final entry for a job that streams or is followed by an inline hub (the
    gateway's whole answers: a field of the hub's wake entry tells it at once); nothing for any
    other (its result key is what its reader polls: no stream is made for it)."""
    return entry if item.stream.enabled or is_inline(item.claim.wake) else {}


class JobEnder:
    """Builds and runs the endings of this worker's jobs, and records each one that happened."""

    def __init__(
        self,
        adapter: RQAdapter,
        link: RedisLink,
        model_name: str,
        metrics: WorkerMetrics,
        tokenizer: Any = None,
        formats: dict[str, str] | None = None,
    ) -> None:
        self.adapter = adapter
        self.link = link
        self.model_name = model_name
        self.metrics = metrics
        self.num_ended = 0
        # Decodes token_texts at job end, on the control thread: a tokenizer of its own.
        self._tokenizer = tokenizer
        # The chat formats of the model (worker/template_formats.py), carried in each result.
        self.formats = formats or {}

    def _result(
        self, item: InFlight, output: Any, status: str, error: str | None = None
    ) -> GenerationResult:
        first = item.first_token_at
        timings = Timings(
            queued_s=round(item.started_at - item.enqueued_at, 6),
            ttft_s=round(first - item.enqueued_at, 6) if first else None,
            total_s=round(time.time() - item.enqueued_at, 6),
        )
        asked_logprobs = item.request is not None and item.request.logprobs is not None
        decode = self._tokenizer.batch_decode if asked_logprobs and self._tokenizer else None
        result = build_result(
            item.job_id,
            item.request,
            output,
            status=status,
            model=self.model_name,
            worker=self.adapter.name,
            timings=timings,
            error=error,
            batch_decode=decode,
        )
        if item.request is not None and item.request.messages is not None:
            for name, value in self.formats.items():
                setattr(result, name, value)
        return result

    def _ending(
        self, claim: Claim, result: GenerationResult, final: dict[str, str], **end: Any
    ) -> tuple[ScriptCall, Command]:
        """The END call of a job and the SET that stages its result for it: the result never
        passes through Lua (whose strings cost Redis some 15 instructions a byte); a hub
        reads it from the result key, one MGET per read (gateway/stream_hub.py)."""
        result_json = result.model_dump_json()
        staged = self.adapter.stage_result(claim, result_json)
        call = self.adapter.end_call(
            claim,
            result.status,
            result_json,
            (result.usage.prompt_tokens, result.usage.completion_tokens),
            final,
            error=result.error,
            staged=True,
            **end,
        )
        return call, staged

    # --- the endings -----------------------------------------------------------------------------

    def finish(self, item: InFlight, output: Any, last: list = ()) -> Ending:
        """The ending of a job whose request finished in the engine (run by the caller).
        `last`: its entries not written yet (`stream_entries`), which go in its END call for
        a job of an inline hub, else back in `Ending.entries` for the caller's STREAM call."""
        inline = is_inline(item.claim.wake)
        result = self._result(item, output, "finished")
        summary = {
            "job_id": item.job_id,
            "status": "finished",
            "finish_reason": result.finish_reason,
            "usage": result.usage.model_dump(),
            "result_key": result_key(item.job_id),
        }
        final = _final(item, done_entry(result.finish_reason))
        call, staged = self._ending(
            item.claim,
            result,
            final,
            rq_return_value=summary,
            stream_ttl_set=item.stream.ttl_set,
            entries=[fields for _, fields, _ in last] if inline else (),
        )
        return Ending(
            item.job_id, "finished", call, result, output, item.enqueued_at, item.claim, staged,
            [] if inline else list(last),
        )  # fmt: skip

    def fail(self, item: InFlight, message: str) -> None:
        """End a job as failed for good (the error is in the job, not the worker)."""
        result = self._result(item, item.last_output, "failed", error=message)
        call, staged = self._ending(item.claim, result, _final(item, error_entry(message)))
        self.run(
            Ending(
                item.job_id,
                "failed",
                call,
                result,
                item.last_output,
                item.enqueued_at,
                staged=staged,
            )
        )

    def fail_claim(self, claim: Claim, message: str) -> None:
        """Fail a job that never reached the engine (malformed hash, bad request)."""
        result = build_result(
            claim.job_id,
            None,
            None,
            status="failed",
            model=self.model_name,
            worker=self.adapter.name,
            timings=Timings(),
            error=message,
        )
        call, staged = self._ending(claim, result, error_entry(message))
        self.run(Ending(claim.job_id, "failed", call, result, staged=staged))

    def cancel(self, item: InFlight) -> None:
        """End a job as canceled (RQ's canceled registry, error=canceled)."""
        result = self._result(item, item.last_output, "canceled", error="canceled")
        final = _final(item, error_entry("canceled"))
        call, staged = self._ending(item.claim, result, final)
        self.run(
            Ending(
                item.job_id,
                "canceled",
                call,
                result,
                item.last_output,
                item.enqueued_at,
                staged=staged,
            )
        )

    def requeue(self, items: list[InFlight], *, count_crash: bool, reason: str) -> None:
        """Put jobs back at the front of their queues; a crash counts against each job."""
        calls = [
            self.adapter.requeue_call(
                item.claim,
                count_crash=count_crash,
                result_json=self._result(
                    item, item.last_output, "failed", reason
                ).model_dump_json(),
                reason=reason,
            )
            for item in items
        ]
        self.link.run(calls)

    # --- after the script ran --------------------------------------------------------------------

    def run(self, ending: Ending) -> None:
        """Run one ending's script now (or when Redis is back), then record it."""
        calls = [ending.staged, ending.call] if ending.staged else [ending.call]
        self.link.run(calls, lambda replies: self.ended(ending, replies[-1][0]))

    def ended(self, ending: Ending, reply: Any) -> None:
        """The ending script ran: count, observe and log the end unless the lease was lost."""
        if not reply:
            log.warning("lease lost: job not ended by this worker", job_id=ending.job_id)
            return
        self.num_ended += 1
        output, result = ending.output, ending.result
        prompt = generated = reason = queued = None
        if output is not None and result.embeddings is not None:  # an embedding job
            prompt, generated, reason = result.usage.prompt_tokens, 0, result.finish_reason
        elif output is not None:
            prompt = len(output.prompt_token_ids or [])
            generated = sum(len(c.token_ids) for c in output.outputs)
            reason = output.outputs[0].finish_reason if output.outputs else None
            scheduled = output.metrics.first_scheduled_time
            if scheduled is not None and ending.enqueued_at is not None:
                queued = scheduled - ending.enqueued_at
        self.metrics.observe_job_end(
            ending.status, reason, prompt, generated, queued, result.timings.total_s
        )
        log_job_end(
            ending.job_id,
            ending.status,
            finish_reason=reason,
            prompt_tokens=prompt,
            completion_tokens=generated,
            timings=result.timings.model_dump(),
            error=result.error if ending.status == "failed" else None,
        )
