"""The `pagedq` command: producer subcommands from producer.cli, `worker`, `demo` and `models`
from worker.cli and `serve` from gateway.cli, each imported only when asked for, so a producer-only
install (`pip install pagedq`) runs submit/status/result/cancel and explains what `pagedq
worker` and `pagedq serve` need."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

WORKER_COMMANDS = ("worker", "demo", "models")
# What `pip install 'pagedq[worker]'` adds and worker/ needs at once.
WORKER_EXTRA_MODULES = ("torch", "transformers", "gguf", "structlog", "prometheus_client")
# What `pip install 'pagedq[gateway]'` adds for `pagedq serve` (no torch).
GATEWAY_EXTRA_MODULES = ("fastapi", "uvicorn", "multipart", "sse_starlette", "prometheus_client")


def missing_worker_modules() -> list[str]:
    """The modules of the worker extra that are not installed."""
    return [m for m in WORKER_EXTRA_MODULES if importlib.util.find_spec(m) is None]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pagedq` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        missing = [m for m in GATEWAY_EXTRA_MODULES if importlib.util.find_spec(m) is None]
        if missing:
            print(
                "`pagedq serve` needs the gateway extra: pip install 'pagedq[gateway]' "
                f"(missing: {', '.join(missing)})",
                file=sys.stderr,
            )
            return 1
        from gateway.cli import serve_main

        return serve_main(argv[1:])
    if argv and argv[0] in WORKER_COMMANDS:
        missing = missing_worker_modules()
        if missing:
            print(
                f"`pagedq {argv[0]}` needs the worker extra: pip install 'pagedq[worker]' "
                f"(missing: {', '.join(missing)})",
                file=sys.stderr,
            )
            return 1
        from worker.cli import demo_main, models_main, worker_main

        command = {"worker": worker_main, "demo": demo_main, "models": models_main}[argv[0]]
        return command(argv[1:]) or 0
    from producer.cli import main as producer_main

    return producer_main(argv)


if __name__ == "__main__":
    sys.exit(main())
