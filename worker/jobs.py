"""Turning an RQ job into a generation request, and engine outputs into a GenerationResult."""

from __future__ import annotations

from typing import Any

from rq.exceptions import DeserializationError
from rq.job import Job

from producer.errors import InvalidRequestError
from producer.schema import GENERATE_FUNC, GenerationRequest, GenerationResult

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


def parse_job(job: Job, model_name: str) -> GenerationRequest:
    """Validate a dequeued job as a pagedq generation; never imports or calls anything it names."""
    try:
        func_name, args, kwargs = job.func_name, job.args, job.kwargs
    except DeserializationError:
        raise JobRejected(
            "job data is not valid JSON; pagedq workers read JSON-serialized jobs only"
        ) from None
    if func_name != GENERATE_FUNC:
        raise JobRejected(
            f"job names function {func_name!r}; a pagedq worker runs only {GENERATE_FUNC!r}"
        )
    if kwargs or len(args) != 1 or not isinstance(args[0], dict):
        raise JobRejected(
            "job arguments must be args=[payload] with payload a JSON object and kwargs={}, "
            f"got {len(args)} args and kwargs {sorted(kwargs)}"
        )
    try:
        request = GenerationRequest.parse(args[0])
    except InvalidRequestError as exc:
        raise JobRejected(str(exc)) from None
    if request.model is not None and request.model != model_name:
        raise JobRejected(
            f"model: job asks for {request.model!r} but this worker serves {model_name!r}"
        )
    return request


def sampling_kwargs(request: GenerationRequest) -> dict[str, Any]:
    """The SamplingParams keywords of a request."""
    return {name: getattr(request, name) for name in SAMPLING_FIELDS}


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
) -> GenerationResult:
    """The GenerationResult of a job from its last RequestOutput (None if it never ran)."""
    completions = list(output.outputs) if output is not None else []
    choices = [
        {
            "index": c.index,
            "text": c.text,
            "token_ids": list(c.token_ids),
            "finish_reason": c.finish_reason,
            "logprobs": c.logprobs,
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
