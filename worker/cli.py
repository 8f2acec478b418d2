"""`pagedq worker` and `pagedq demo`; producer.cli dispatches its subcommands here."""

from __future__ import annotations

import argparse
import os
import sys

from worker.config import REDIS_URL_ENV, WorkerConfig


def build_worker_parser() -> argparse.ArgumentParser:
    """The argument parser of `pagedq worker`."""
    d = WorkerConfig()
    p = argparse.ArgumentParser(
        prog="pagedq worker",
        description="Serve one queue with one model: a continuously batching RQ worker.",
    )
    p.add_argument(
        "--redis-url",
        default=os.environ.get(REDIS_URL_ENV) or d.redis_url,
        help=f"redis:// or rediss:// URL, user:password@ for ACL users (default: ${REDIS_URL_ENV}"
        f" or {d.redis_url})",
    )
    p.add_argument("--queue", default=d.queue, help="queue name (default: %(default)s)")
    p.add_argument("--model", default=d.model, help="model id, HF folder or GGUF file")
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument("--dtype", default=d.dtype, help="auto, float32, bfloat16, float16")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--kv-cache-memory", default=None, help="KV cache budget, e.g. 512MiB (default: auto)"
    )
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--scheduling-policy",
        choices=["priority", "fcfs"],
        default=d.scheduling_policy,
        help="order of the jobs held by the engine (default %(default)s: lower priority first)",
    )
    p.add_argument(
        "--result-ttl",
        type=int,
        default=d.result_ttl,
        help="seconds a finished job's result (pagedq:result:{id}), RQ job and registry entries "
        "are kept (default 7 days)",
    )
    p.add_argument("--stream-ttl", type=int, default=d.stream_ttl, help="seconds (default 1 day)")
    p.add_argument(
        "--lease-ttl",
        type=int,
        default=d.lease_ttl,
        help="seconds after which a dead worker's jobs are re-run elsewhere (default %(default)s)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=d.drain_timeout,
        help="on SIGTERM, seconds to finish in-flight jobs before requeueing them",
    )
    p.add_argument(
        "--max-crashes",
        type=int,
        default=d.max_crashes,
        help="a job in flight during this many worker crashes fails instead of re-running "
        "(default %(default)s)",
    )
    p.add_argument(
        "--job-timeout",
        type=float,
        default=d.job_timeout,
        help="longest wall-clock seconds a job may run; a job's own RQ `timeout` may only "
        "shorten it; a job over it fails with error 'timeout' (default %(default)s)",
    )
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port; 0 = off")
    p.add_argument(
        "--metrics-host",
        default=d.metrics_host,
        help="address /metrics binds to (default %(default)s; 0.0.0.0 for all interfaces)",
    )
    p.add_argument("--log-format", choices=["console", "json"], default="console")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--name", default=None, help="worker name (default: random)")
    p.add_argument(
        "--burst", action="store_true", help="exit once the queue is empty and nothing is in flight"
    )
    return p


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """The WorkerConfig of parsed `pagedq worker` arguments."""
    return WorkerConfig(
        redis_url=args.redis_url,
        queue=args.queue,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        max_model_len=args.max_model_len,
        scheduling_policy=args.scheduling_policy,
        result_ttl=args.result_ttl,
        stream_ttl=args.stream_ttl,
        lease_ttl=args.lease_ttl,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        max_crashes=args.max_crashes,
        job_timeout=args.job_timeout,
        name=args.name,
        burst=args.burst,
        drain_timeout=args.drain_timeout,
    )


def worker_main(argv: list[str] | None = None) -> int:
    """`pagedq worker ...` (argv without the subcommand): load the model once, then serve."""
    parser = build_worker_parser()
    args = parser.parse_args(argv)
    for flag, value, low in (
        ("--max-crashes", args.max_crashes, 1),
        ("--job-timeout", args.job_timeout, 0.001),
        ("--lease-ttl", args.lease_ttl, 1),
    ):
        if not value >= low:
            parser.error(f"{flag}: must be >= {low}, got {value}")
    from worker.logs import configure_logging
    from worker.service import run_worker

    configure_logging(args.log_format, args.log_level.upper())
    return run_worker(config_from_args(args))


def demo_main(argv: list[str] | None = None) -> int:
    """`pagedq demo ...`: a private Redis, one worker, a handful of prompts, one streamed live."""
    from worker.demo import run_demo

    return run_demo(argv)


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
