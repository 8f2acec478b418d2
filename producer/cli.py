"""The producer commands of `pagedq`: submit, status, result, cancel (never imports worker/).

`pagedq worker` and `pagedq demo` are dispatched by the `pagedq` entry module (pagedq_cli.py),
which loads worker/ only for them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer.bulk import BadInputFileError, StaleOutputError, run_bulk
from producer.client import DEFAULT_REPLICA_ACK_TIMEOUT_MS, Client
from producer.connection import RedisURLError
from producer.contract.keys import (
    DEFAULT_QUEUE,
    DEFAULT_REDIS_URL,
    DEFAULT_RESULT_TTL,
    REDIS_URL_ENV,
)
from producer.contract.routing import TENANT_RE
from producer.contract.schema import GenerationRequest
from producer.errors import (
    JobCanceledError,
    JobFailedError,
    JobNotFoundError,
    RedisFullError,
    ReplicaAckError,
)
from producer.refusal import RedisRefusedError, refusal
from producer.retry import redact_url
from producer.status import format_status, queue_status

WORKER_COMMANDS = ("worker", "demo")
# Exit codes: 1 = a job or line failed / an id is unknown / Redis unreachable; 2 = bad usage
# or a refused input file (argparse's code); 130 = interrupted; 141 = stdout closed (SIGPIPE).
EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 1, 2, 130, 141


def main(argv: Sequence[str] | None = None) -> int:
    """Run one producer subcommand; returns the exit code (never a traceback for Redis down)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in WORKER_COMMANDS:
        print(
            f"`{argv[0]}` is a worker command: run it as `pagedq {argv[0]}` "
            "(needs pip install 'pagedq[worker]')",
            file=sys.stderr,
        )
        return EXIT_USAGE
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="pagedq: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return _stdout_closed()
    except RedisURLError as exc:
        print(f"pagedq: --redis-url {redact_url(args.redis_url)}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RedisRefusedError as exc:
        print(f"pagedq: {exc.refusal.message(at=f' at {redact_url(args.redis_url)}')}",
              file=sys.stderr)  # fmt: skip
        return EXIT_FAILED
    except (RedisConnectionError, RedisTimeoutError, NoPermissionError) as exc:
        print(f"pagedq: {_unreachable(args.redis_url, exc)}", file=sys.stderr)
        return EXIT_FAILED
    except (RedisFullError, ReplicaAckError) as exc:
        print(f"pagedq: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except RedisError as exc:  # e.g. something else than Redis listens there
        print(f"pagedq: Redis at {redact_url(args.redis_url)} failed: {exc}", file=sys.stderr)
        return EXIT_FAILED


def _unreachable(url: str, exc: Exception) -> str:
    """Why Redis could not be used: a refusal (credentials, ACL, certificate) says so,
    anything else is 'cannot reach'."""
    refused = refusal(exc)
    if refused is not None:
        return refused.message(at=f" at {redact_url(url)}")
    return f"cannot reach Redis at {redact_url(url)}: {exc}"


def _stdout_closed() -> int:
    # The reader went away (`pagedq result ID --json | head`): point stdout at /dev/null so
    # the interpreter's final flush does not raise again, and exit like SIGPIPE would.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return EXIT_BROKEN_PIPE


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of every producer subcommand."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--redis-url",
        default=os.environ.get(REDIS_URL_ENV, DEFAULT_REDIS_URL),
        help=f"Redis URL: redis://, rediss://, unix://, "
        f"redis+sentinel://host:port[,host:port...]/service[/db] or "
        f"redis+cluster://host:port[,host:port...] (env {REDIS_URL_ENV}; "
        "default: %(default)s)",
    )
    common.add_argument(
        "--queue",
        default=os.environ.get("PAGEDQ_QUEUE", DEFAULT_QUEUE),
        help="queue name (env PAGEDQ_QUEUE; default: %(default)s)",
    )
    common.add_argument(
        "--queue-shards",
        type=_int_at_least(1),
        default=os.environ.get("PAGEDQ_QUEUE_SHARDS", "1"),
        help="shards the queue is split over, as the workers' --queue-shards "
        "(env PAGEDQ_QUEUE_SHARDS; default: %(default)s)",
    )
    parser = argparse.ArgumentParser(prog="pagedq", description="Batch LLM inference over Redis.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("submit", parents=[common], help="bulk-generate a JSONL file (resumable)")
    p.add_argument("input", help='JSONL: OpenAI Batch API lines or plain {"prompt": ...} lines')
    p.add_argument(
        "-o", "--output", required=True, help="JSONL in OpenAI batch output format (appended)"
    )
    p.add_argument("--window", type=int, default=1024, help="max jobs in flight (default: 1024)")
    p.add_argument(
        "--chunk-size", type=int, default=256, help="jobs per Redis round trip (default: 256)"
    )
    p.add_argument(
        "--model",
        help="pin the model; a worker serving another one fails the job (default: any)",
    )
    p.add_argument(
        "--tenant",
        help="tenant of every line: workers share service between tenants by weight "
        "(default: none)",
    )
    p.add_argument(
        "--priority",
        type=int,
        help="priority of every line, lower runs sooner across the queue (default: each line's, "
        "else 0)",
    )
    p.add_argument("--batch-id", help="job-id namespace (default: from the input file's path)")
    p.add_argument(
        "--response-format",
        metavar="FILE",
        help="JSON file with an OpenAI response_format (e.g. a json_schema) for every line that "
        "has none (default: each line's own)",
    )
    p.add_argument("--retries", type=int, default=3, help="RQ retries per job (default: 3)")
    p.add_argument(
        "--result-ttl",
        type=int,
        default=DEFAULT_RESULT_TTL,
        help="seconds results stay in Redis (default: %(default)s = 7 days)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: shown)")
    add_replica_ack_flags(p)
    p.set_defaults(func=_submit)

    p = sub.add_parser("status", parents=[common], help="queue depth, job counts, workers")
    p.add_argument("--json", action="store_true", help="print JSON (default: a table)")
    p.set_defaults(func=_status)

    p = sub.add_parser("result", parents=[common], help="wait for a job and print its result")
    p.add_argument("job_id", help="the job id printed by submit (or derived from custom_id)")
    p.add_argument("--timeout", type=float, help="seconds to wait (default: forever)")
    p.add_argument(
        "--json", action="store_true", help="print the whole result as JSON (default: the text)"
    )
    p.add_argument(
        "--stream", action="store_true", help="print the text as it is generated (default: off)"
    )
    p.set_defaults(func=_result)

    p = sub.add_parser("cancel", parents=[common], help="cancel a queued or running job")
    p.add_argument("job_id", help="the job to cancel")
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

    for name in WORKER_COMMANDS:  # run by the `pagedq` entry module; listed here for --help
        what = "run a worker" if name == "worker" else "run a local demo"
        sub.add_parser(name, help=f"{what} (needs pagedq[worker])", add_help=False)
    sub.add_parser("serve", help="OpenAI-compatible HTTP gateway (needs pagedq[gateway])")
    return parser


def add_replica_ack_flags(parser: argparse.ArgumentParser) -> None:
    """--min-replicas-ack and --replica-ack-timeout-ms (pagedq submit, pagedq serve)."""
    parser.add_argument(
        "--min-replicas-ack",
        type=_int_at_least(0),
        default=0,
        metavar="N",
        help="after each enqueue, wait until N replicas have the jobs (Redis WAIT); fewer "
        "within the timeout is an error, the jobs staying queued on the primary (default: 0, "
        "no wait)",
    )
    parser.add_argument(
        "--replica-ack-timeout-ms",
        type=_int_at_least(1),
        default=DEFAULT_REPLICA_ACK_TIMEOUT_MS,
        metavar="MS",
        help="milliseconds an enqueue waits for --min-replicas-ack replicas "
        f"(default: {DEFAULT_REPLICA_ACK_TIMEOUT_MS})",
    )


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    return parse


def _connect(args: argparse.Namespace, **options) -> Client:
    """A Client whose Redis answered a PING (raises RedisConnectionError within seconds)."""
    client = Client(args.redis_url, args.queue, queue_shards=args.queue_shards, **options)
    client.redis.ping()
    return client


def _submit(args: argparse.Namespace) -> int:
    if args.tenant is not None and not TENANT_RE.match(args.tenant):
        print(
            f"pagedq submit: --tenant must be 1 to 64 letters, digits, '_', '.' or '-', "
            f"got {args.tenant!r}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    response_format = None
    if args.response_format is not None:
        try:
            with open(args.response_format, encoding="utf-8") as f:
                response_format = json.load(f)
            GenerationRequest.parse({"prompt": "x", "response_format": response_format})
        except (OSError, ValueError) as exc:
            print(
                f"pagedq submit: --response-format {args.response_format}: {exc}", file=sys.stderr
            )
            return EXIT_USAGE
    client = _connect(
        args,
        result_ttl=args.result_ttl,
        retries=args.retries,
        min_replicas_ack=args.min_replicas_ack,
        replica_ack_timeout_ms=args.replica_ack_timeout_ms,
    )
    try:
        s = run_bulk(
            client,
            args.input,
            args.output,
            window=args.window,
            chunk_size=args.chunk_size,
            model=args.model,
            tenant=args.tenant,
            priority=args.priority,
            batch_id=args.batch_id,
            progress=not args.no_progress,
            response_format=response_format,
        )
    except (BadInputFileError, StaleOutputError, OSError) as exc:
        if isinstance(exc, BrokenPipeError):
            raise
        print(f"pagedq submit: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(
            f"interrupted; run the same command again to resume into {args.output}", file=sys.stderr
        )
        return EXIT_INTERRUPTED
    print(
        f"{s.finished} finished ({s.reused} already computed), {s.failed} failed, "
        f"{s.invalid} invalid lines, {s.skipped} already in {args.output}; "
        f"{s.completion_tokens} tokens generated in {s.elapsed_s:.1f} s "
        f"({s.tokens_per_s:.1f} tok/s)",
        file=sys.stderr,
    )
    return 0 if s.ok else EXIT_FAILED


def _status(args: argparse.Namespace) -> int:
    status = queue_status(_connect(args))
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def _result(args: argparse.Namespace) -> int:
    client = _connect(args)
    try:
        if args.stream:
            for delta in client.stream(args.job_id, timeout=args.timeout):
                print(delta, end="", flush=True)
            print()
            return 0
        result = client.result(args.job_id, timeout=args.timeout)
    except (JobFailedError, JobCanceledError, JobNotFoundError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(result.model_dump_json(indent=2) if args.json else result.text)
    return 0


def _cancel(args: argparse.Namespace) -> int:
    client = _connect(args)
    status = client.status(args.job_id)
    if status == "unknown":
        print(f"error: {JobNotFoundError(args.job_id)}", file=sys.stderr)
        return EXIT_FAILED
    if client.cancel(args.job_id):
        print(f"cancel requested for {args.job_id}")
    else:
        print(f"{args.job_id} already ended ({client.status(args.job_id)}); nothing to cancel")
    return 0


if __name__ == "__main__":
    sys.exit(main())
