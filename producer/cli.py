"""The `pagedq` command: submit, status, result, cancel (producer); worker, demo (worker extra)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from producer.bulk import run_bulk
from producer.client import DEFAULT_REDIS_URL, Client
from producer.errors import JobCanceledError, JobFailedError, JobNotFoundError
from producer.keys import DEFAULT_QUEUE, DEFAULT_RESULT_TTL
from producer.status import format_status, queue_status

WORKER_COMMANDS = ("worker", "demo")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pagedq` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in WORKER_COMMANDS:
        return _worker_command(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of every producer subcommand."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--redis-url",
        default=os.environ.get("PAGEDQ_REDIS_URL", DEFAULT_REDIS_URL),
        help="Redis URL (env PAGEDQ_REDIS_URL; default %(default)s)",
    )
    common.add_argument(
        "--queue",
        default=os.environ.get("PAGEDQ_QUEUE", DEFAULT_QUEUE),
        help="queue name (env PAGEDQ_QUEUE; default %(default)s)",
    )
    parser = argparse.ArgumentParser(prog="pagedq", description="Batch LLM inference over Redis.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("submit", parents=[common], help="bulk-generate a JSONL file (resumable)")
    p.add_argument("input", help='JSONL: OpenAI Batch API lines or plain {"prompt": ...} lines')
    p.add_argument("-o", "--output", required=True, help="JSONL in OpenAI batch output format")
    p.add_argument("--window", type=int, default=1024, help="max jobs in flight (default 1024)")
    p.add_argument("--chunk-size", type=int, default=256, help="jobs per Redis round trip")
    p.add_argument("--model", help="pin the model (refused by a worker serving another one)")
    p.add_argument("--batch-id", help="job-id namespace (default: the input file's path)")
    p.add_argument("--retries", type=int, default=3, help="RQ retries per job (default 3)")
    p.add_argument("--result-ttl", type=int, default=DEFAULT_RESULT_TTL, help="seconds")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_submit)

    p = sub.add_parser("status", parents=[common], help="queue depth, job counts, workers")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_status)

    p = sub.add_parser("result", parents=[common], help="wait for a job and print its result")
    p.add_argument("job_id")
    p.add_argument("--timeout", type=float, help="seconds to wait (default: forever)")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")
    p.add_argument("--stream", action="store_true", help="print the text as it is generated")
    p.set_defaults(func=_result)

    p = sub.add_parser("cancel", parents=[common], help="cancel a queued or running job")
    p.add_argument("job_id")
    p.set_defaults(func=_cancel)

    # Scheduling diagnosis (issue 9): both read only Redis.
    from producer.diagnose import diagnose_command
    from producer.top import top_command

    p = sub.add_parser("diagnose", parents=[common], help="what limits throughput, and the fix")
    p.add_argument("--slo", type=float, help="queue-time objective in seconds")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=diagnose_command)
    p = sub.add_parser("top", parents=[common], help="live view of queues, tenants and workers")
    p.add_argument("--slo", type=float, help="queue-time objective in seconds")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.set_defaults(func=top_command)

    for name in WORKER_COMMANDS:  # parsed by worker.cli; listed here for --help
        what = "run a worker" if name == "worker" else "run a local demo"
        sub.add_parser(name, help=f"{what} (needs pagedq[worker])", add_help=False)
    return parser


def _submit(args: argparse.Namespace) -> int:
    client = Client(args.redis_url, args.queue, result_ttl=args.result_ttl, retries=args.retries)
    try:
        s = run_bulk(
            client,
            args.input,
            args.output,
            window=args.window,
            chunk_size=args.chunk_size,
            model=args.model,
            batch_id=args.batch_id,
            progress=not args.no_progress,
        )
    except KeyboardInterrupt:
        print(
            f"interrupted; run the same command again to resume into {args.output}", file=sys.stderr
        )
        return 130
    print(
        f"{s.finished} finished, {s.failed} failed, {s.invalid} invalid lines, "
        f"{s.skipped} already in {args.output}; {s.completion_tokens} tokens in "
        f"{s.elapsed_s:.1f} s",
        file=sys.stderr,
    )
    if s.duplicates:
        shown = ", ".join(s.duplicates[:5])
        print(f"{len(s.duplicates)} duplicate custom_id line(s) skipped: {shown}", file=sys.stderr)
    return 0


def _status(args: argparse.Namespace) -> int:
    status = queue_status(Client(args.redis_url, args.queue))
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def _result(args: argparse.Namespace) -> int:
    client = Client(args.redis_url, args.queue)
    try:
        if args.stream:
            for delta in client.stream(args.job_id, timeout=args.timeout):
                print(delta, end="", flush=True)
            print()
            return 0
        result = client.result(args.job_id, timeout=args.timeout)
    except (JobFailedError, JobCanceledError, JobNotFoundError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(result.model_dump_json(indent=2) if args.json else result.text)
    return 0


def _cancel(args: argparse.Namespace) -> int:
    if Client(args.redis_url, args.queue).cancel(args.job_id):
        print(f"cancel requested for {args.job_id}")
    else:
        print(f"{args.job_id} was not queued or running; nothing to cancel")
    return 0


def _worker_command(name: str, argv: list[str]) -> int:
    try:
        from worker.cli import demo_main, worker_main
    except ImportError as exc:
        print(
            f"`pagedq {name}` needs the worker extra: pip install 'pagedq[worker]' ({exc})",
            file=sys.stderr,
        )
        return 1
    return (worker_main if name == "worker" else demo_main)(argv) or 0


if __name__ == "__main__":
    sys.exit(main())
