"""`pagedq serve`: the OpenAI-compatible gateway over the queue (needs pagedq[gateway])."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from redis.exceptions import RedisError

from gateway.config import DEFAULT_BATCH_PRIORITY, GatewayConfig, Tenant, load_api_keys
from producer.cli import add_replica_ack_flags
from producer.connection import check_url, redis_client
from producer.contract.keys import DEFAULT_QUEUE, DEFAULT_REDIS_URL, rq_queue_key
from producer.refusal import refusal
from producer.retry import redact_url


def build_parser() -> argparse.ArgumentParser:
    """The flags of `pagedq serve`."""
    p = argparse.ArgumentParser(
        prog="pagedq serve", description="OpenAI-compatible HTTP gateway over the pagedq queue"
    )
    p.add_argument(
        "--redis-url",
        default=os.environ.get("PAGEDQ_REDIS_URL", DEFAULT_REDIS_URL),
        help="the Redis holding the queue ($PAGEDQ_REDIS_URL when set): redis://, rediss://, "
        "unix://, redis+sentinel://host:port[,host:port...]/service[/db] or "
        "redis+cluster://host:port[,host:port...]",
    )
    p.add_argument("--queue", default=DEFAULT_QUEUE, help="RQ queue name")
    p.add_argument(
        "--queue-shards",
        type=int,
        default=1,
        help="shards the queue is split over, as the workers' --queue-shards",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (non-loopback needs keys)")
    p.add_argument("--port", type=int, default=8000, help="port to bind")
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="a bearer key accepted (repeatable; no tenant); also $PAGEDQ_API_KEY",
    )
    p.add_argument(
        "--api-keys-file",
        help='JSON {"KEY": {"tenant": T, "priority": P, "batch_priority": B}, ...}',
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve without keys on a non-loopback --host (e.g. in a container whose port is "
        "published on 127.0.0.1 only)",
    )
    p.add_argument(
        "--batch-priority",
        type=int,
        default=DEFAULT_BATCH_PRIORITY,
        help="priority of batch lines (lower runs first; online requests use 0)",
    )
    p.add_argument("--max-file-bytes", type=int, default=200 * 2**20, help="largest batch file")
    p.add_argument("--max-file-lines", type=int, default=50_000, help="most requests per file")
    p.add_argument(
        "--batch-lease-seconds",
        type=float,
        default=15.0,
        help="a gateway that died working on a batch is replaced after this long",
    )
    p.add_argument(
        "--file-chunk-bytes",
        type=int,
        default=1 << 20,
        help="files are stored, and batches enqueued, in chunks of whole lines of this size",
    )
    add_replica_ack_flags(p)
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return p


def flags_markdown() -> str:
    """The flags table of docs/GATEWAY.md, generated from the parser (a test compares them)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for action in build_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        default = action.default
        shown = "-" if default in (None, [], False) else f"`{default}`"
        if action.dest == "redis_url":
            shown = f"`{DEFAULT_REDIS_URL}`"  # not the environment of whoever generates it
        rows.append(f"| `{action.option_strings[0]}` | {shown} | {action.help} |")
    return "\n".join(rows)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """The GatewayConfig of parsed flags (ValueError with a readable message)."""
    keys: dict[str, Tenant] = {}
    if args.api_keys_file:
        keys.update(load_api_keys(args.api_keys_file, args.batch_priority))
    for key in args.api_key + (
        [os.environ["PAGEDQ_API_KEY"]] if os.environ.get("PAGEDQ_API_KEY") else []
    ):
        keys.setdefault(key, Tenant(batch_priority=args.batch_priority))
    config = GatewayConfig(
        redis_url=args.redis_url,
        queue=args.queue,
        queue_shards=args.queue_shards,
        host=args.host,
        port=args.port,
        api_keys=keys,
        max_file_bytes=args.max_file_bytes,
        max_file_lines=args.max_file_lines,
        batch_priority=args.batch_priority,
        batch_lease_s=args.batch_lease_seconds,
        file_chunk_bytes=args.file_chunk_bytes,
        min_replicas_ack=args.min_replicas_ack,
        replica_ack_timeout_ms=args.replica_ack_timeout_ms,
    )
    check_url(config.redis_url)
    if not args.allow_unauthenticated:
        config.check()
    return config


def serve_main(argv: Sequence[str] | None = None) -> int:
    """Run the gateway until SIGINT/SIGTERM; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"pagedq serve: {exc}", file=sys.stderr)
        return 2
    refused = redis_refusal(config.redis_url, config.queue)
    if refused is not None:
        print(f"pagedq serve: {refused}", file=sys.stderr)
        return 1
    import uvicorn

    from gateway.app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="pagedq serve: %(message)s")
    logging.getLogger("pagedq.gateway").info(
        "serving http://%s:%d/v1 on queue %s of %s (%d API keys)",
        config.host,
        config.port,
        config.queue,
        redact_url(config.redis_url),
        len(config.api_keys),
    )
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=5,
        # Clients (and load balancers) keep connections between requests; uvicorn's 5 s
        # would close them under a client about to reuse them.
        timeout_keep_alive=75,
    )
    return 0


if __name__ == "__main__":
    sys.exit(serve_main())


def redis_refusal(url: str, queue: str) -> str | None:
    """One line when Redis refuses the gateway (credentials, ACL, certificate): a setting to
    fix, so the gateway stops at once. None otherwise, an unreachable Redis included: the
    gateway starts and answers 503 until it is back."""
    client = redis_client(url, socket_connect_timeout=5, socket_timeout=5)
    try:
        client.ping()
        client.llen(rq_queue_key(queue))  # a key the ACL must allow
    except RedisError as exc:
        found = refusal(exc)
        return None if found is None else found.message(at=f" at {redact_url(url)}")
    finally:
        client.close()
    return None
