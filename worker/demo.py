"""`pagedq demo`: the whole service on one machine, in one command, cleaned up afterwards."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Give one tip for learning to code.",
]


def build_demo_parser() -> argparse.ArgumentParser:
    """The argument parser of `pagedq demo`."""
    p = argparse.ArgumentParser(
        prog="pagedq demo",
        description="Start a private Redis and one worker, run a few prompts, stream one live.",
    )
    p.add_argument(
        "--redis-url",
        default=None,
        help="use this Redis instead of a private one (default: start a private redis-server)",
    )
    p.add_argument("--model", default="smollm2", help="model to serve (default: %(default)s)")
    p.add_argument("--queue", default="pagedq-demo", help="queue name (default: %(default)s)")
    p.add_argument(
        "--max-tokens", type=int, default=64, help="tokens per answer (default: %(default)s)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds to wait for the answers (default: %(default)s)",
    )
    return p


def run_demo(argv: list[str] | None = None) -> int:
    """Run the demo; every process it started is stopped on exit, Ctrl-C included."""
    args = build_demo_parser().parse_args(argv)
    # `kill` (SIGTERM) cleans up like Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    from worker.redis_server import PrivateRedis

    private: PrivateRedis | None = None
    worker: subprocess.Popen | None = None
    # The worker's log is kept only when something went wrong, and its path printed then.
    fd, name = tempfile.mkstemp(prefix="pagedq-demo-worker-", suffix=".log")
    os.close(fd)
    log_path = Path(name)
    keep_log = False
    try:
        if args.redis_url is None:
            private = PrivateRedis()
            redis_url = private.url
            print(f"started a private redis-server at {redis_url}")
        else:
            redis_url = args.redis_url
        worker = _start_worker(redis_url, args, log_path)
        print(f"started a worker with model {args.model!r}")
        _run_prompts(redis_url, args, worker, log_path)
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted; cleaning up")
        return 130
    except RuntimeError as exc:
        keep_log = True
        print(f"\npagedq demo: {exc}", file=sys.stderr)
        return 1
    finally:
        if worker is not None:
            _stop(worker)
        if private is not None:
            private.close()
        if keep_log:
            print(f"the worker's log is kept at {log_path}", file=sys.stderr)
        else:
            log_path.unlink(missing_ok=True)


def _start_worker(redis_url: str, args: argparse.Namespace, log_path: Path) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "worker",
        "--redis-url", redis_url,
        "--queue", args.queue,
        "--model", args.model,
        "--name", f"demo-{os.getpid()}",
        "--drain-timeout", "5",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        # Own session: Ctrl-C reaches only the demo, which then stops the worker itself.
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _run_prompts(
    redis_url: str, args: argparse.Namespace, worker: subprocess.Popen, log_path: Path
) -> None:
    from producer.client import Client

    client = Client(redis_url, queue=args.queue, check_interval=1.0)
    fields = {"temperature": 0.0, "max_tokens": args.max_tokens}
    # The first answer streams live; the others are bulk jobs that write their result only.
    job_ids = [client.submit(messages=[{"role": "user", "content": DEMO_PROMPTS[0]}], **fields)]
    job_ids += client.submit_many(
        {"messages": [{"role": "user", "content": p}], **fields} for p in DEMO_PROMPTS[1:]
    )
    print(f"submitted {len(job_ids)} prompts; loading the model takes a while on a CPU...\n")
    deadline = time.monotonic() + args.timeout
    print(f">>> {DEMO_PROMPTS[0]}")
    _wait_first_token(client, job_ids[0], worker, log_path, deadline)
    for delta in client.stream(job_ids[0], timeout=max(1.0, deadline - time.monotonic())):
        print(delta, end="", flush=True)
    print("\n")
    for prompt, job_id in zip(DEMO_PROMPTS[1:], job_ids[1:], strict=True):
        result = client.result(job_id, timeout=max(1.0, deadline - time.monotonic()))
        print(f">>> {prompt}\n{result.text.strip()}\n")
    print(f"done: {len(job_ids)} jobs, one worker, continuous batching over Redis.")
    client.close()


def _wait_first_token(client, job_id, worker, log_path, deadline) -> None:
    """Wait for the worker to start the job, failing fast (with its log) if the worker died."""
    while client.status(job_id) == "queued":
        if worker.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the worker exited with code {worker.returncode}:\n{tail}")
        if time.monotonic() > deadline:
            raise RuntimeError("timed out waiting for the worker to start the first job")
        time.sleep(0.5)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
