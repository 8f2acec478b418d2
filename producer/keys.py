"""Job ids and Redis key names shared by producers and workers: the single source of truth."""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from typing import Any

GENERATE_FUNC = "pagedq.generate"
"""The only function name a pagedq job may carry; the worker refuses any other."""

DEFAULT_QUEUE = "pagedq"
DEFAULT_RESULT_TTL = 7 * 24 * 3600
DEFAULT_STREAM_TTL = 24 * 3600
DEFAULT_CANCEL_TTL = 24 * 3600
STREAM_MAXLEN = 10_000

KEY_PREFIX = "pagedq"
CANCEL_CHANNEL = f"{KEY_PREFIX}:cancel"
WORKER_KEY_PATTERN = f"{KEY_PREFIX}:worker:*"

# Short names of models, and the Hugging Face id each stands for.
MODEL_ALIASES = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}
# A quantization or precision tag at the end of a weights file name (".Q4_1", "-f16", ...).
_WEIGHTS_TAG = re.compile(r"[.-](q\d\w*|iq\d\w*|f16|f32|bf16|fp16|fp32)$", re.IGNORECASE)


def canonical_model(model: str) -> str:
    """One lower-case name per model, so aliases, GGUF paths and hub ids of a model match.

    `smollm2`, `.../SmolLM2-135M-Instruct.Q4_1.gguf` and `HuggingFaceTB/SmolLM2-135M-Instruct`
    all give `huggingfacetb/smollm2-135m-instruct`; a path to another model gives its real path.
    """
    name = model.strip()
    known = {alias: hub.lower() for alias, hub in MODEL_ALIASES.items()}
    by_stem = {hub.split("/")[-1].lower(): hub.lower() for hub in MODEL_ALIASES.values()}
    if name.lower() in known:
        return known[name.lower()]
    stem = os.path.basename(name.rstrip("/"))
    if stem.lower().endswith(".gguf"):
        stem = _WEIGHTS_TAG.sub("", stem[: -len(".gguf")])
    if stem.lower() in by_stem:
        return by_stem[stem.lower()]
    is_hub_id = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if is_hub_id and not os.path.exists(name):
        return name.lower()
    return os.path.realpath(os.path.expanduser(name))


def model_queue(queue: str, model: str | None) -> str:
    """The RQ queue of a job: `{queue}@{canonical model}` when it asks for a model, else `queue`."""
    return queue if model is None else f"{queue}@{canonical_model(model)}"


def request_digest(payload: dict[str, Any]) -> str:
    """sha256 hex of a job payload's canonical JSON (sorted keys, no spaces), custom_id left out."""
    body = {k: v for k, v in payload.items() if k != "custom_id"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def job_id_for(
    custom_id: str | None, queue: str = DEFAULT_QUEUE, payload: dict[str, Any] | None = None
) -> str:
    """The job id of a request: derived from `custom_id` (idempotent), else a fresh uuid4 hex.

    With `payload` (what producers always pass) the id is
    "pq-" + sha256(f"{queue}:{custom_id}:{request_digest(payload)}")[:32]: the same custom_id
    with the same request is the same job, with a different request a new job.
    """
    if custom_id is None:
        return uuid.uuid4().hex
    key = f"{queue}:{custom_id}"
    if payload is not None:
        key += ":" + request_digest(payload)
    return "pq-" + hashlib.sha256(key.encode()).hexdigest()[:32]


def result_key(job_id: str) -> str:
    """Key of the plain JSON GenerationResult of a job."""
    return f"{KEY_PREFIX}:result:{job_id}"


def stream_key(job_id: str) -> str:
    """Key of the Redis stream carrying a job's token deltas and its final done/error entry."""
    return f"{KEY_PREFIX}:stream:{job_id}"


def cancel_key(job_id: str) -> str:
    """Key whose presence ("1") asks workers to cancel a job."""
    return f"{KEY_PREFIX}:cancel:{job_id}"


def batch_counts_key(batch_id: str) -> str:
    """Hash of a batch's line counts: `finished`, `failed`, `canceled` (+1 as each of its jobs
    ends, in the script that ends it) and `prompt_tokens`, `completion_tokens` of finished ones.

    A job carries its batch id in the job-hash field `pq_batch`; the count is kept only while
    this hash exists (the batch's owner creates it).
    """
    return f"{KEY_PREFIX}:batch:{batch_id}:counts"


def worker_key(name: str) -> str:
    """Key of a worker's JSON heartbeat {in_flight, running, waiting, kv_cache_usage, ...}."""
    return f"{KEY_PREFIX}:worker:{name}"
