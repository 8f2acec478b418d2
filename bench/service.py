"""The worker fed through Redis against the offline engine, on the same prompts.

    python bench/service.py                  # 64 jobs
    python bench/service.py --num-jobs 16 --max-output 32     # a quick look
    python bench/service.py --rounds 3       # alternate the two, report every round's ratio

Offline: ``LLM`` steps every request in a child process (bench/peers.py's pagedq runner).
Service: a private redis-server, one real ``python -m worker`` process (same engine settings),
all jobs submitted at once with the producer ``Client`` once the worker's first heartbeat shows
the model is loaded; the time runs from the submit to the last result read back. Prints both
output tokens/s and the service's share of offline (the goal is >= 90%). With ``--rounds N``
both run N times in alternating order (a drifting machine favours whoever runs first); the
table shows each one's median run, and every round's ratio is printed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def start_worker(redis_url: str, queue: str, args, log_path: Path) -> subprocess.Popen:
    """A real worker process with the offline run's engine settings."""
    cmd = [
        sys.executable, "-m", "worker", "--redis-url", redis_url, "--queue", queue,
        "--model", args.model, "--dtype", args.dtype, "--name", "bench-service",
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--kv-cache-memory", f"{args.kv_cache_gib}GiB", "--log-level", "WARNING",
    ]  # fmt: skip
    # The worker pins its own threads (worker/cli.py), as peers.py pins the offline child.
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def wait_ready(conn, proc: subprocess.Popen, log_path: Path, timeout: float = 600) -> None:
    """Until the worker's first heartbeat (model loaded, loop running)."""
    from producer.contract.keys import worker_key

    deadline = time.monotonic() + timeout
    while conn.get(worker_key("bench-service")) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"worker not ready:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)


def run_service(work: dict, args) -> dict:
    """Submit every job at once through Redis; time until every result is back."""
    from producer.client import Client
    from worker.redis_server import PrivateRedis

    server = PrivateRedis()
    server.start()
    log_path = Path(tempfile.gettempdir()) / f"pagedq-bench-service-{os.getpid()}.log"
    url = f"redis://127.0.0.1:{server.port}/0"
    proc = start_worker(url, "bench", args, log_path)
    try:
        conn = server.client()
        wait_ready(conn, proc, log_path)
        client = Client(url, queue="bench")
        # A warm-up job, as the offline run has: first-call costs are not throughput.
        client.result(client.submit(work["prompts"][0], max_tokens=4, temperature=0.0), 600)
        jobs = [
            {"prompt": p, "max_tokens": n, "temperature": 0.0, "ignore_eos": True}
            for p, n in zip(work["prompts"], work["out_lens"])
        ]
        start = time.perf_counter()
        ids = client.submit_many(jobs)
        tokens = sum(len(client.result(i, timeout=3600).token_ids) for i in ids)
        elapsed = time.perf_counter() - start
        assert tokens == sum(work["out_lens"]), (tokens, sum(work["out_lens"]))
        return {"tokens": tokens, "elapsed": elapsed, "tokens_per_s": tokens / elapsed}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        server.close()


def main() -> None:
    import peers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-jobs", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=20)
    ap.add_argument("--max-prompt", type=int, default=200)
    ap.add_argument("--min-output", type=int, default=64)
    ap.add_argument("--max-output", type=int, default=192)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--rounds", type=int, default=1,
        help="run both this many times, alternating their order; report the median runs",
    )  # fmt: skip
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    args.hf_batch_size, args.no_bind = 16, False  # what peers' child command line carries

    from throughput import make_workload

    from engine.model_loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(args.model))
    spec = (args.num_jobs, args.min_prompt, args.max_prompt, args.min_output, args.max_output)
    prompts, out_lens = make_workload(tok, *spec, seed=args.seed)
    work = {"name": "service", "spec": spec, "prompts": prompts, "out_lens": out_lens}

    load_before = peers.load_average()
    runs: dict[str, list[dict]] = {"offline": [], "service": []}
    for r in range(args.rounds):
        for name in ("offline", "service") if r % 2 == 0 else ("service", "offline"):
            if name == "offline":
                result = peers.run_child("pagedq", work, args, None)
                if result is None:
                    raise SystemExit("the offline run failed; rerun with -v")
            else:
                print(f"[service] round {r + 1}: the worker through Redis ...", flush=True)
                result = run_service(work, args)
            runs[name].append(result)
    offline, service = peers.median_run(runs["offline"]), peers.median_run(runs["service"])
    print(
        f"\n{args.num_jobs} jobs, prompts {args.min_prompt}-{args.max_prompt} tokens, outputs "
        f"{args.min_output}-{args.max_output} (total {sum(out_lens)}), {args.dtype}; load "
        f"average {load_before} before, {peers.load_average()} after"
    )
    print("| run | output tokens/s | seconds |")
    print("|---|---:|---:|")
    print(f"| offline LLM | {offline['tokens_per_s']:.1f} | {offline['elapsed']:.1f} |")
    print(f"| worker via Redis | {service['tokens_per_s']:.1f} | {service['elapsed']:.1f} |")
    print(f"\nworker / offline: {service['tokens_per_s'] / offline['tokens_per_s']:.2f}")
    if args.rounds > 1:
        ratios = [
            s["tokens_per_s"] / o["tokens_per_s"] for s, o in zip(runs["service"], runs["offline"])
        ]
        print("by round: " + ", ".join(f"{x:.2f}" for x in ratios) + " (median runs above)")


if __name__ == "__main__":
    main()
