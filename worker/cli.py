"""`pagedq worker`, `pagedq demo` and `pagedq models` (the `pagedq` entry module, pagedq_cli.py,
dispatches here)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from engine.config import EngineConfig
from producer.contract.keys import DEFAULT_REDIS_URL, REDIS_URL_ENV
from worker.config import WorkerConfig
from worker.flags import (
    Flag,
    FlagSpec,
    add_dataclass_flags,
    check_bounds,
    dataclass_from_args,
    show_default,
)
from worker.limits import JobLimits

# Engine fields whose flag is not the field's own name, or that need a NAME=VALUE form.
ENGINE_FLAG_SPECS = {
    "tenant_weights": FlagSpec(flag="--tenant-weight", metavar="NAME=WEIGHT"),
}


@dataclass(frozen=True, slots=True)
class WorkerFlags:
    """The parser of `pagedq worker` and the generated flags, by config section."""

    parser: argparse.ArgumentParser
    engine: list[Flag]
    limits: list[Flag]
    worker: list[Flag]

    @property
    def all(self) -> list[Flag]:
        """Every generated flag, in --help order."""
        return [*self.engine, *self.limits, *self.worker]


def worker_flags() -> WorkerFlags:
    """Build `pagedq worker`'s parser from EngineConfig, JobLimits and WorkerConfig."""
    p = argparse.ArgumentParser(
        prog="pagedq worker",
        description="Serve one queue with one model: a continuously batching RQ worker.",
    )
    engine = add_dataclass_flags(
        p.add_argument_group("engine (EngineConfig, the LLM(...) keyword arguments)"),
        EngineConfig,
        specs=ENGINE_FLAG_SPECS,
    )
    # Old spelling of --no-enable-prefix-caching, kept for existing deployments.
    p.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help=argparse.SUPPRESS,
    )
    limits = add_dataclass_flags(
        p.add_argument_group("per-job limits (JobLimits, docs/LIMITS.md)"),
        JobLimits,
    )
    defaults = WorkerConfig(redis_url=os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL)
    own = add_dataclass_flags(
        p.add_argument_group("worker"), WorkerConfig, defaults=defaults, skip=("engine", "limits")
    )
    return WorkerFlags(p, engine, limits, own)


def build_worker_parser() -> argparse.ArgumentParser:
    """The argument parser of `pagedq worker`."""
    return worker_flags().parser


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """The WorkerConfig of parsed `pagedq worker` arguments (ValueError from a bad value)."""
    return dataclass_from_args(
        WorkerConfig,
        args,
        engine=dataclass_from_args(EngineConfig, args),
        limits=dataclass_from_args(JobLimits, args),
    )


def flags_markdown() -> str:
    """The README's table of `pagedq worker` flags (regenerate with
    `python -c "from worker.cli import flags_markdown; print(flags_markdown())"`)."""
    lines = ["| flag | default | meaning |", "|---|---|---|"]
    defaults = {EngineConfig: EngineConfig(), JobLimits: JobLimits(), WorkerConfig: WorkerConfig()}
    for flag in worker_flags().all:
        name = f"`{flag.flag}`"
        if flag.kind == "bool":
            name = f"`{flag.flag}` / `--no-{flag.flag[2:]}`"
        default = show_default(getattr(defaults[flag.owner], flag.field))
        text = flag.help.replace("%%", "%").replace("|", "\\|")
        lines.append(f"| {name} | `{default}` | {text} |")
    return "\n".join(lines)


def worker_main(argv: list[str] | None = None) -> int:
    """`pagedq worker ...` (argv without the subcommand): load the model once, then serve."""
    parser = build_worker_parser()
    args = parser.parse_args(argv)
    for cls in (EngineConfig, JobLimits, WorkerConfig):
        check_bounds(parser, cls, args)
    try:
        config = config_from_args(args)
        cpu_bind_mode()
    except ValueError as exc:
        parser.error(str(exc))
    from worker.logs import configure_logging
    from worker.service import open_redis, run_worker

    configure_logging(config.log_format, config.log_level.upper())
    # Redis answers (or the one-line reason it does not) before the re-exec below, which
    # imports torch a second time: a wrong URL or password is told in half the time.
    connection = open_redis(config)
    if isinstance(connection, int):
        return connection
    pin_threads_and_reexec(config.engine, argv)  # returns only when it does not re-exec
    return run_worker(config, connection)


CPU_BIND_CHOICES = ("auto", "none")


def cpu_bind_mode() -> str:
    """``PAGEDQ_CPU_BIND`` (default ``auto``); ValueError names the allowed values."""
    bind = os.environ.get("PAGEDQ_CPU_BIND", "auto")
    if bind not in CPU_BIND_CHOICES:
        raise ValueError(
            f"PAGEDQ_CPU_BIND={bind!r} is invalid: must be one of {list(CPU_BIND_CHOICES)}"
        )
    return bind


def pin_threads_and_reexec(engine: EngineConfig, argv: list[str] | None) -> None:
    """On a CPU that the worker uses whole, start again with its OpenMP threads pinned per core.

    libgomp reads ``GOMP_CPU_AFFINITY`` once, when torch loads it, and worker/cli.py has imported
    torch by now: so the process replaces itself (same PID) with the variable set. Pinned
    threads measured up to 4x faster on a busy 2-core host. ``PAGEDQ_CPU_BIND=none`` (or any
    ``GOMP_CPU_AFFINITY``/``OMP_NUM_THREADS`` of your own) leaves the threads as they are.
    Raises ValueError for any other ``PAGEDQ_CPU_BIND`` than ``auto`` or ``none``.
    """
    bind = cpu_bind_mode()
    if bind == "none" or engine.device.startswith("cuda") or engine.tensor_parallel_size > 1:
        return  # tensor-parallel ranks share the cores: each takes its share of threads
    if os.environ.get("GOMP_CPU_AFFINITY") or os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    if engine.device == "auto" and torch.cuda.is_available():
        return
    from engine.cpu_threads import bind_env

    env = bind_env(engine.num_threads)
    if env:
        args = list(sys.argv[1:] if argv is None else argv)
        os.execve(sys.executable, [sys.executable, "-m", "worker", *args], {**os.environ, **env})


def demo_main(argv: list[str] | None = None) -> int:
    """`pagedq demo ...`: a private Redis, one worker, a handful of prompts, one streamed live."""
    from worker.demo import run_demo

    return run_demo(argv)


def models_main(argv: list[str] | None = None) -> int:
    """`pagedq models`: every model type pagedq claims, and the path that serves it."""
    p = argparse.ArgumentParser(
        prog="pagedq models",
        description="List the supported model types: native (a family file of pagedq's) or "
        "transformers (the Transformers modeling backend, verified by its tests).",
    )
    p.add_argument(
        "--markdown",
        action="store_true",
        help="print README's table instead: model_type, the path serving it, the tests holding it",
    )
    if p.parse_args(argv).markdown:
        from worker.models_table import models_markdown

        print(models_markdown())
        return 0
    from engine.models import model_impls

    impls = model_impls()
    width = max(map(len, impls))
    print(f"{'model_type':<{width}}  path")
    for model_type, path in impls.items():
        print(f"{model_type:<{width}}  {path}")
    print(
        "\n--model-impl transformers runs a native type on the backend too; other decoder-only "
        "attention families run on it unverified, and what it cannot run is refused at load."
    )
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
