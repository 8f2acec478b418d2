"""Turning an RQ job into a generation request, and engine outputs into a GenerationResult."""

from __future__ import annotations

from typing import Any

from rq.exceptions import DeserializationError
from rq.job import Job

from producer.errors import InvalidRequestError
from producer.job_data import PayloadTooLargeError, inflate, is_plain_json_array
from producer.schema import GENERATE_FUNC, GenerationRequest, GenerationResult
from worker.limits import JobLimits, ModelLimits

# The GenerationRequest fields that are also SamplingParams keywords (same names, same defaults).
SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
)


class JobRejected(Exception):
    """A job that can never run (wrong function, bad fields): it fails at once, without retries."""


def bounded_job_class(limits: JobLimits) -> type[Job]:
    """An RQ `Job` class that inflates `data` (and `exc_info`) at most to the payload limit.

    RQ's own `Job.restore` runs `zlib.decompress` on them unbounded: a few MB of zeros
    compressed would take the worker's memory. Give it to RQ as `job_class`; `parse_job`
    then refuses the oversized job with its reason.
    """

    class BoundedJob(Job):
        max_payload_bytes = limits.max_payload_bytes
        payload_error: str | None = None

        def restore(self, raw_data: dict) -> Any:
            fields = dict(raw_data)
            for name in (b"data", "data"):
                if name in fields:
                    fields[name] = self._bounded(fields[name])
            for name in (b"exc_info", "exc_info"):
                if name in fields:
                    try:
                        inflate(fields[name], self.max_payload_bytes)
                    except PayloadTooLargeError:
                        fields.pop(name)
            return super().restore(fields)

        def _bounded(self, raw: bytes | str) -> bytes:
            raw = raw.encode() if isinstance(raw, str) else raw
            try:
                data = inflate(raw, self.max_payload_bytes)
            except PayloadTooLargeError as exc:
                self.payload_error = str(exc)
                return b"null"
            if not is_plain_json_array(data):
                # Possibly zlib again: RQ would inflate it a second time, unbounded.
                self.payload_error = "job data is not a JSON array"
                return b"null"
            return data

    return BoundedJob


def parse_job(
    job: Job,
    model_name: str,
    limits: JobLimits | None = None,
    model_limits: ModelLimits | None = None,
) -> GenerationRequest:
    """Validate a dequeued job as a pagedq generation; never imports or calls anything it names.

    Checks, in order: the payload size (before any JSON parsing), the function name and
    argument shape, the wire schema, the worker's `limits`, and, given `model_limits`, the
    model's vocabulary and context. Raises JobRejected with a message naming the field.
    """
    limits = limits or JobLimits()
    payload_error = getattr(job, "payload_error", None)
    if payload_error:
        raise JobRejected(payload_error)
    try:
        size = len(job.data)
    except DeserializationError:
        size = 0
    if size > limits.max_payload_bytes:
        raise JobRejected(
            f"job data is {size} bytes: must be at most max_payload_bytes="
            f"{limits.max_payload_bytes}"
        )
    try:
        func_name, args, kwargs = job.func_name, job.args, job.kwargs
    except DeserializationError:
        raise JobRejected(
            "job data is not valid JSON; pagedq workers read JSON-serialized jobs only"
        ) from None
    except (TypeError, ValueError):
        raise JobRejected("job data must be a JSON array [func_name, null, args, kwargs]") from None
    if func_name != GENERATE_FUNC:
        raise JobRejected(
            f"job names function {str(func_name)[:80]!r}; a pagedq worker runs only "
            f"{GENERATE_FUNC!r}"
        )
    if not isinstance(kwargs, dict) or not isinstance(args, list | tuple):
        raise JobRejected("job arguments must be args=[payload] and kwargs={}")
    if kwargs or len(args) != 1 or not isinstance(args[0], dict):
        raise JobRejected(
            "job arguments must be args=[payload] with payload a JSON object and kwargs={}, "
            f"got {len(args)} args and kwargs {sorted(kwargs)[:10]}"
        )
    try:
        request = GenerationRequest.parse(args[0])
    except InvalidRequestError as exc:
        raise JobRejected(str(exc)) from None
    if request.model is not None and request.model != model_name:
        raise JobRejected(
            f"model: job asks for {request.model!r} but this worker serves {model_name!r}"
        )
    check_limits(request, limits, model_limits)
    return request


def _refuse(field: str, value: Any, allowed: str) -> JobRejected:
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return JobRejected(f"invalid request: {field}: must be {allowed}, got {text}")


def check_limits(
    request: GenerationRequest, limits: JobLimits, model: ModelLimits | None = None
) -> None:
    """Refuse a schema-valid request that exceeds this worker's limits or the model's."""
    if request.n > limits.max_n:
        raise _refuse("n", request.n, f"<= {limits.max_n} (this worker's max_n)")
    if request.logprobs is not None and request.logprobs > limits.max_logprobs:
        raise _refuse("logprobs", request.logprobs, f"<= {limits.max_logprobs}")
    stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
    if len(stops) > limits.max_stop:
        raise _refuse("stop", f"{len(stops)} strings", f"at most {limits.max_stop} strings")
    stop_ids = request.stop_token_ids or []
    if len(stop_ids) > limits.max_stop_token_ids:
        raise _refuse(
            "stop_token_ids", f"{len(stop_ids)} ids", f"at most {limits.max_stop_token_ids} ids"
        )
    if model is None:
        return
    vocab = model.vocab_size
    bad = [t for t in stop_ids if t >= vocab]
    if bad:
        raise _refuse("stop_token_ids", bad[:3], f"token ids < vocab size {vocab}")
    if isinstance(request.prompt, list):
        bad = [t for t in request.prompt if t >= vocab]
        if bad:
            raise _refuse("prompt", bad[:3], f"token ids < vocab size {vocab}")
        if len(request.prompt) >= model.max_model_len:
            raise _refuse(
                "prompt",
                f"{len(request.prompt)} tokens",
                f"shorter than max_model_len={model.max_model_len}",
            )
        if len(request.prompt) + request.min_tokens > model.max_model_len:
            raise _refuse(
                "min_tokens",
                request.min_tokens,
                f"<= max_model_len - prompt tokens = {model.max_model_len - len(request.prompt)}",
            )


def sampling_kwargs(request: GenerationRequest, limits: JobLimits | None = None) -> dict[str, Any]:
    """The SamplingParams keywords of a request, `max_tokens` capped by `limits.max_tokens`.

    Past the context, the engine ends a generation at `max_model_len` ("length") anyway.
    """
    kwargs = {name: getattr(request, name) for name in SAMPLING_FIELDS}
    if limits is not None and limits.max_tokens is not None:
        kwargs["max_tokens"] = min(kwargs["max_tokens"], limits.max_tokens)
        kwargs["min_tokens"] = min(kwargs["min_tokens"], kwargs["max_tokens"])
    return kwargs


def token_texts(logprobs: list[dict[int, float]] | None, decode: Any) -> dict[int, str] | None:
    """The text of every token id in `logprobs` (`decode([id])` each, in one batch call);
    None without logprobs. `decode` is a tokenizer's `batch_decode`."""
    if logprobs is None:
        return None
    ids = sorted({int(t) for entry in logprobs for t in entry})
    return dict(zip(ids, decode([[t] for t in ids]), strict=True))


def build_result(
    job_id: str,
    request: GenerationRequest | None,
    output: Any | None,
    *,
    status: str,
    model: str,
    worker: str,
    timings: dict[str, float | None],
    error: str | None = None,
    batch_decode: Any = None,
) -> GenerationResult:
    """The GenerationResult of a job from its last RequestOutput (None if it never ran).

    With `batch_decode` (a tokenizer's), each choice with logprobs gets `token_texts`.
    """
    completions = list(output.outputs) if output is not None else []
    choices = [
        {
            "index": c.index,
            "text": c.text,
            "token_ids": list(c.token_ids),
            "finish_reason": c.finish_reason,
            "logprobs": c.logprobs,
            "token_texts": token_texts(c.logprobs, batch_decode) if batch_decode else None,
        }
        for c in completions
    ]
    first = choices[0] if choices else {}
    prompt_ids = getattr(output, "prompt_token_ids", None) or []
    return GenerationResult.model_validate(
        {
            "job_id": job_id,
            "custom_id": request.custom_id if request else None,
            "status": status,
            "text": first.get("text", ""),
            "token_ids": first.get("token_ids", []),
            "finish_reason": first.get("finish_reason"),
            "logprobs": first.get("logprobs"),
            "token_texts": first.get("token_texts"),
            "choices": choices if len(choices) > 1 else [],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": sum(len(c["token_ids"]) for c in choices),
            },
            "timings": timings,
            "model": model,
            "worker": worker,
            "error": error,
            "metadata": request.metadata if request else None,
        }
    )
