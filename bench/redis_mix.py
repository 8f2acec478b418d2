"""Instructions Redis executes per job over a whole run of the simulated fleet: the real mix of
calls, counted so that no noisy neighbour moves the figure.

bench/redis_instructions.py counts each step of a job at one batch size; a fleet's calls carry
as many jobs as its timing gives them (a streamed job's first token and its end are written at
once, a dequeue takes the room that a step freed). This bench runs bench/redis_capacity.py's
simulated fleet and producers for each profile against a redis-server under valgrind's
callgrind, and divides the instructions the server executed in the whole run (start to
shutdown: loading the scripts, the ramp, the fleet's fixed costs and the server's own cron
included; kernel time, such as a round trip's system calls, not) by the jobs run. Under
callgrind the server is some 50x slower, so the fleet is small (2 workers of 50 slots), and its
registries are skip lists as in a large fleet (`--zset-max-listpack-entries 0`: a small fleet's
would be listpacks, whose every insert parses each score they hold). A rerun differs by about
1 %.

    .venv/bin/python bench/redis_mix.py                       # stream and bulk, about 1 minute
    git worktree add /tmp/base HEAD~1
    .venv/bin/python bench/redis_mix.py --baseline /tmp/base --profiles stream,bulk
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVER_ARGS = ("--zset-max-listpack-entries", "0")
WRAPPER = """#!/bin/sh
if [ "$1" = "--version" ]; then exec {server} --version; fi
exec valgrind --tool=callgrind --callgrind-out-file={out}/callgrind.out.%p {server} "$@" {args}
"""


def child(repo: Path, profile: str, jobs: int, workers: int, keep: Path | None = None) -> None:
    """One profile's run with the code of `repo`; prints its instructions per job as JSON."""
    sys.path[:0] = [str(repo), str(repo / "bench")]
    import redis_capacity as rc

    from worker.redis_server import REDIS_SERVER_ENV, PrivateRedis, find_redis_server

    server = find_redis_server()
    with tempfile.TemporaryDirectory(prefix="pagedq-mix-") as out:
        wrapper = Path(out, "redis-server")
        wrapper.write_text(WRAPPER.format(server=server, out=out, args=" ".join(SERVER_ARGS)))
        wrapper.chmod(0o755)
        os.environ[REDIS_SERVER_ENV] = str(wrapper)

        class SlowRedis(PrivateRedis):
            """Started under callgrind: it answers after seconds, not milliseconds."""

            def start(self, timeout: float = 120.0) -> None:
                super().start(timeout)

        rc.PrivateRedis = SlowRedis
        sim = rc.Sim(workers=workers, slots=50, steps_per_s=40.0, tokens=200, prompt_chars=200,
                     drivers=1, lease_ttl=60, window=round(1.25 * workers * 50))  # fmt: skip
        rc.measure_profile(sim, mp.get_context("fork"), profile, jobs)
        total = 0
        deadline = time.monotonic() + 60
        while not total and time.monotonic() < deadline:
            time.sleep(0.5)  # callgrind writes its totals as the server exits
            for path in Path(out).glob("callgrind.out.*"):
                for line in path.read_text(errors="replace").splitlines():
                    if line.startswith(("totals:", "summary:")):
                        total = max(total, int(line.split()[1]))
        if not total:
            raise SystemExit("callgrind wrote no totals")
        if keep:
            keep.mkdir(parents=True, exist_ok=True)
            for path in Path(out).glob("callgrind.out.*"):
                shutil.copy(path, keep / f"{profile}.{path.name}")
    print(json.dumps({"per_job": total / jobs}))


def measure(repo: Path, profile: str, jobs: int, workers: int, keep: Path | None = None) -> float:
    """Instructions per job of `profile` with the code of `repo` (a child process each, so
    that each checkout imports its own modules)."""
    args = [sys.executable, __file__, "--child", str(repo), "--profiles", profile,
            "--jobs", str(jobs), "--workers", str(workers)]  # fmt: skip
    if keep:
        args += ["--keep", str(keep)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"the {profile} run with {repo} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["per_job"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", default="stream,bulk", help="bench/redis_capacity.py profiles")
    ap.add_argument("--jobs", type=int, default=400, help="jobs per run")
    ap.add_argument("--workers", type=int, default=2, help="simulated workers of 50 slots")
    ap.add_argument("--baseline", type=Path, help="a checkout of the code to compare with")
    ap.add_argument(
        "--keep", type=Path, help="copy the server's callgrind files here (callgrind_annotate)"
    )
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.profiles, args.jobs, args.workers, args.keep)
        return
    if not shutil.which("valgrind"):
        print("valgrind (callgrind) is not installed: nothing measured")
        return
    runs = [("this checkout", REPO)]
    if args.baseline:
        runs.insert(0, ("baseline", args.baseline.resolve()))
    print(f"Instructions redis-server executes per job over a whole run (callgrind Ir), "
          f"{args.jobs} jobs, {args.workers} simulated workers of 50 slots")  # fmt: skip
    print(
        "| profile | " + " | ".join(n for n, _ in runs) + (" | ratio |" if args.baseline else " |")
    )
    print("|---|" + "---:|" * (len(runs) + (1 if args.baseline else 0)))
    for profile in args.profiles.split(","):
        values = [measure(repo, profile, args.jobs, args.workers, args.keep) for _, repo in runs]
        ratio = f" | {values[-1] / values[0]:.2f} |" if args.baseline else " |"
        print(f"| {profile} | " + " | ".join(f"{v:,.0f}" for v in values) + ratio, flush=True)


if __name__ == "__main__":
    main()
