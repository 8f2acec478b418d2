"""Redis CPU per streamed token with a real worker, as a new user streams: jobs read live.

One private redis-server, one real `python -m worker` process, `--jobs` jobs of `--tokens`
tokens each (ignore_eos) submitted with `Client.submit` (they stream) and each read live by
its own thread with `Client.stream`. Measured from the first submit to the last reader done:
Redis's own CPU (INFO cpu) and the commands it ran (INFO commandstats), per job and per
streamed token, writers and readers together; and that every reader's text equals the job's
result.

    .venv/bin/python bench/stream_live.py                       # this checkout, smollm2
    .venv/bin/python bench/stream_live.py --code before=/work/main --code after=.
    .venv/bin/python bench/stream_live.py --model tiny --stream-interval 0.1

With `--code NAME=DIR` each variant runs this script again with DIR's code (worker, client),
one after the other on the same machine, and the table gives each one and the ratios to the
first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = Path(os.environ.get("PAGEDQ_BENCH_CODE") or HERE.parents[1]).resolve()
sys.path[:0] = [str(REPO)]


def _cpu(r) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def _calls(r) -> int:
    return sum(int(v["calls"]) for v in r.info("commandstats").values())


def run_one(args: argparse.Namespace) -> dict:
    """One variant: this process's code (PYTHONPATH) for the worker and the readers."""
    from producer.client import Client
    from producer.contract.keys import stream_key, worker_key
    from worker.redis_server import PrivateRedis

    with PrivateRedis() as server, tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == "tiny":  # a tiny random Llama (tests/tiny_models.py): fast engine steps
            sys.path.insert(0, str(REPO / "tests"))
            from tiny_models import make_tiny_model

            model = str(make_tiny_model(Path(tmp) / "tiny", "llama"))
        cmd = [
            sys.executable, "-m", "worker", "--redis-url", server.url, "--queue", "live",
            "--model", model, "--name", "live", "--log-level", "WARNING",
            "--max-num-seqs", str(args.jobs), "--kv-cache-memory", args.kv_cache_memory,
        ]  # fmt: skip
        if args.stream_interval is not None:
            cmd += ["--stream-interval", str(args.stream_interval)]
        log_path = Path(tmp) / "worker.log"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        try:
            r = server.client()
            deadline = time.monotonic() + 900
            while r.get(worker_key("live")) is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker not ready:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.2)
            client = Client(server.url, queue="live")
            # One warm-up job: the first step compiles and allocates.
            client.result(client.submit("warm up", max_tokens=4), timeout=600)
            texts: dict[str, str] = {}
            cpu0, calls0, t0 = _cpu(r), _calls(r), time.monotonic()
            job_ids = [
                client.submit(
                    f"Story number {i}: once upon a time",
                    max_tokens=args.tokens,
                    ignore_eos=True,
                    temperature=0.8,
                    seed=i,
                )
                for i in range(args.jobs)
            ]

            def read(job_id: str) -> None:
                texts[job_id] = "".join(client.stream(job_id, timeout=900))

            threads = [threading.Thread(target=read, args=(j,)) for j in job_ids]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            dt = time.monotonic() - t0
            cpu, calls = _cpu(r) - cpu0, _calls(r) - calls0
            results = [client.result(j) for j in job_ids]
            entries = sum(r.xlen(stream_key(j)) for j in job_ids)
        finally:
            proc.terminate()
            proc.wait(60)
    tokens = sum(res.usage.completion_tokens for res in results)
    return {
        "jobs": len(job_ids),
        "tokens": tokens,
        "seconds": dt,
        "entries_per_job": entries / len(job_ids),
        "cpu_us_per_job": cpu * 1e6 / len(job_ids),
        "cpu_us_per_token": cpu * 1e6 / tokens,
        "commands_per_job": calls / len(job_ids),
        "text_mismatches": sum(texts[res.job_id] != res.text for res in results),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="a model, or tiny (a random Llama)")
    p.add_argument("--jobs", type=int, default=96)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--stream-interval", type=float, default=None, help="the worker's flag")
    p.add_argument("--code", action="append", default=[], help="NAME=DIR, a variant's code")
    p.add_argument("--json", action="store_true", help="print one variant's figures as JSON")
    args = p.parse_args()
    if not args.code:
        out = run_one(args)
        print(json.dumps(out) if args.json else out)
        return
    rows = []
    for spec in args.code:
        name, _, code = spec.partition("=")
        argv = [a for a in sys.argv[1:] if not a.startswith("--code")]
        argv = [a for a in argv if a not in args.code] + ["--json"]
        env = {**os.environ, "PAGEDQ_BENCH_CODE": str(Path(code).resolve())}
        env["PYTHONPATH"] = env["PAGEDQ_BENCH_CODE"]
        done = subprocess.run(
            [sys.executable, str(HERE), *argv], env=env, capture_output=True, text=True
        )
        if done.returncode:
            raise SystemExit(f"variant {name} failed:\n{done.stderr[-3000:]}")
        rows.append((name, json.loads(done.stdout.strip().splitlines()[-1])))
        print(name, rows[-1][1], flush=True)
    first = rows[0][1]
    print("\n| variant | entries/job | Redis us/job | Redis us/token | commands/job | vs first |")
    print("|---|---|---|---|---|---|")
    for name, f in rows:
        ratio = first["cpu_us_per_token"] / f["cpu_us_per_token"]
        print(
            f"| {name} | {f['entries_per_job']:.1f} | {f['cpu_us_per_job']:.0f} | "
            f"{f['cpu_us_per_token']:.1f} | {f['commands_per_job']:.0f} | "
            f"{ratio:.2f}x lower |"
        )


if __name__ == "__main__":
    main()
