"""A stand-in for the worker's writing side, for producer tests that must not load a model.

It pops job ids from the RQ queue list and writes what the contract says a worker writes:
token entries, the result key, then the final stream entry. The real worker is tested end to
end in tests/worker.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from producer.keys import result_key, stream_key


def write_finished(
    r: Redis, job_id: str, deltas: list[str], custom_id: str | None = None, prompt_tokens: int = 3
) -> None:
    """Write a finished job's stream (one entry per delta, then done) and its result key."""
    token_ids = list(range(len(deltas)))
    for i, delta in enumerate(deltas):
        r.xadd(stream_key(job_id), {"event": "token", "delta": delta, "token_ids": f"[{i}]"})
    result = {
        "job_id": job_id,
        "custom_id": custom_id,
        "status": "finished",
        "text": "".join(deltas),
        "token_ids": token_ids,
        "finish_reason": "stop",
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(deltas)},
        "timings": {"queued_s": 0.01, "ttft_s": 0.02, "total_s": 0.03},
        "model": "fake",
        "worker": "fake-worker",
    }
    pipe = r.pipeline()
    pipe.set(result_key(job_id), json.dumps(result))
    pipe.xadd(stream_key(job_id), {"event": "done", "finish_reason": "stop"})
    pipe.execute()


def write_failed(r: Redis, job_id: str, error: str) -> None:
    """Write a failed job's result key and final error entry."""
    pipe = r.pipeline()
    result = {"job_id": job_id, "status": "failed", "error": error}
    pipe.set(result_key(job_id), json.dumps(result))
    pipe.xadd(stream_key(job_id), {"event": "error", "error": error})
    pipe.execute()


class FakeWorker(threading.Thread):
    """Answers each job with "echo: <prompt>" in two deltas; counts how often each job ran."""

    def __init__(self, url: str, queue: str = "pagedq", delay_s: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.redis = Redis.from_url(url)
        self.queue_key = f"rq:queue:{queue}"
        self.delay_s = delay_s
        self.runs: Counter[str] = Counter()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            popped = self.redis.blpop([self.queue_key], timeout=0.1)
            if popped is None:
                continue
            job = Job.fetch(popped[1].decode(), connection=self.redis, serializer=JSONSerializer)
            payload = job.args[0]
            prompt = payload.get("prompt") or payload["messages"][-1]["content"]
            time.sleep(self.delay_s)
            self.runs[job.id] += 1
            if prompt == "FAIL":
                write_failed(self.redis, job.id, "ValueError: fake failure")
            else:
                write_finished(
                    self.redis, job.id, ["echo: ", str(prompt)], payload.get("custom_id")
                )

    def stop(self) -> None:
        """Stop the thread and wait for it."""
        self._stop_event.set()
        self.join(timeout=5)
        self.redis.close()
