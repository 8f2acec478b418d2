"""`pagedq top`: a live terminal view of the queues, the tenants and every worker (rich)."""

from __future__ import annotations

import argparse
import contextlib
import select
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

from redis import Redis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from producer.client import Client
from producer.diagnose import collect, diagnose

REFRESH_SECONDS = 1.0


def _pct(value: Any) -> str:
    return f"{value:.0%}" if isinstance(value, int | float) else "-"


def _num(value: Any, fmt: str = "{:.0f}") -> str:
    return fmt.format(value) if isinstance(value, int | float) else "-"


def render(
    workers: list[dict[str, Any]],
    lengths: Mapping[str, int],
    slo: float | None = None,
    now: float | None = None,
) -> Group:
    """One frame: queues, tenants, workers, and what limits throughput."""
    now = time.time() if now is None else now
    queues = Table(title="queues", title_justify="left", expand=False)
    queues.add_column("queue")
    queues.add_column("queued", justify="right")
    for name, n in lengths.items():
        queues.add_row(name, str(n))

    tenant_tokens: dict[str, int] = {}
    for w in workers:
        for tenant, n in (w.get("tenant_generated_tokens") or {}).items():
            if isinstance(n, int):
                tenant_tokens[tenant] = tenant_tokens.get(tenant, 0) + n
    total = sum(tenant_tokens.values())
    tenants = Table(title="tenants (tokens generated)", title_justify="left")
    tenants.add_column("tenant")
    tenants.add_column("tokens", justify="right")
    tenants.add_column("share", justify="right")
    for tenant, n in sorted(tenant_tokens.items(), key=lambda kv: -kv[1]):
        tenants.add_row(tenant, str(n), _pct(n / total if total else 0))

    table = Table(title=f"workers ({len(workers)})", title_justify="left")
    for col in ("worker", "model", "in flight", "running", "waiting", "swapped", "kv", "tok/s"):
        table.add_column(col, justify="left" if col in ("worker", "model") else "right")
    for col in ("preempt rc/sw", "queue s", "age"):
        table.add_column(col, justify="right")
    for w in workers:
        pre = w.get("preemptions") if isinstance(w.get("preemptions"), dict) else {}
        updated = w.get("updated_at")
        table.add_row(
            str(w.get("name", "?")),
            str(w.get("model", "-")),
            _num(w.get("in_flight")),
            _num(w.get("running")),
            _num(w.get("waiting")),
            _num(w.get("swapped")),
            _pct(w.get("kv_cache_usage")),
            _num(w.get("generation_tokens_per_s"), "{:.1f}"),
            f"{_num(pre.get('recompute'))}/{_num(pre.get('swap'))}",
            _num(w.get("job_queue_time_s", w.get("mean_queue_time_s")), "{:.1f}"),
            _num(now - updated if isinstance(updated, int | float) else None, "{:.0f}s"),
        )
    findings = diagnose(workers, lengths, slo, now)
    notes = Text("\n".join(str(f) for f in findings) or "nothing limits throughput", style="dim")
    stamp = Text(time.strftime("%H:%M:%S", time.localtime(now)) + "  (q or Ctrl-C quits)")
    return Group(stamp, queues, tenants, table, notes)


def frame(
    redis: Redis, queue: str, slo: float | None = None, shard_names: list[str] | None = None
) -> Group:
    """Read Redis once and render (a sharded queue's length is its ``shard_names``' sum)."""
    workers, lengths = collect(redis, queue, shard_names)
    return render(workers, lengths, slo)


@contextlib.contextmanager
def _cbreak() -> Iterator[bool]:
    """Single-key reads from a terminal stdin; yields False when stdin is not a terminal."""
    if not sys.stdin.isatty():
        yield False
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    old = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, old)


def _wait_for_quit(seconds: float, keys: bool) -> bool:
    if not keys:
        time.sleep(seconds)
        return False
    ready, _, _ = select.select([sys.stdin], [], [], seconds)
    return bool(ready) and sys.stdin.read(1).lower() == "q"


def run_top(
    redis: Redis,
    queue: str,
    slo: float | None = None,
    once: bool = False,
    console=None,
    shard_names: list[str] | None = None,
) -> int:
    """Refresh every second until q or Ctrl-C; ``once`` prints one frame and returns."""
    # Piped output (a file, a test) gets a wide frame instead of rich's 80-column default.
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    if once:
        console.print(frame(redis, queue, slo, shard_names))
        return 0
    try:
        with _cbreak() as keys, Live(console=console, auto_refresh=False, screen=False) as live:
            while True:
                live.update(frame(redis, queue, slo, shard_names), refresh=True)
                if _wait_for_quit(REFRESH_SECONDS, keys):
                    return 0
    except KeyboardInterrupt:
        return 0


def top_command(args: argparse.Namespace) -> int:
    """`pagedq top [--once] [--slo S]`."""
    client = Client(args.redis_url, args.queue, queue_shards=args.queue_shards)
    return run_top(client.redis, args.queue, args.slo, args.once, shard_names=client.shards.names)
