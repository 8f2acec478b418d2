"""Time to first token through the gateway against the Python client, and idle streams held.

Starts a private redis-server, a real worker (a tiny random Llama by default, one OpenMP
thread) and two `pagedq serve` processes on loopback, then, in one run:

1. TTFT of `--streams` concurrent streamed chat requests, through the gateway (OpenAI's SDK,
   `stream=True`) and through the Python client (`Client.submit` + `Client.stream`), in
   alternating rounds; p50 and p99 of each.
2. Idle streams: `--idle` streamed requests on a queue no worker serves, opened against one
   gateway process and held `--hold` seconds; how many it holds open, its memory, and how fast
   a live request on the other gateway is served meanwhile. Bounded in count and time, loopback
   only; every stream is closed (which cancels its job) before the end.

    .venv/bin/python bench/gateway.py --streams 200 --idle 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from openai import AsyncOpenAI, OpenAI

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]
from worker_process import WorkerProcess  # noqa: E402

from producer.client import Client  # noqa: E402
from worker.redis_server import PrivateRedis, free_port  # noqa: E402

QUEUE = "bench"
IDLE_QUEUE = "bench-idle"  # no worker serves it: its jobs stay queued, their streams idle
PROMPT = "Write one sentence about the sea, number {i}."
OPEN_TIMEOUT_S = 120.0


def start_gateway(redis_url: str, queue: str, log_dir: Path) -> tuple[subprocess.Popen, str]:
    """A `pagedq serve` process on a free loopback port; (process, base URL)."""
    port = free_port()
    log = open(log_dir / f"gateway-{queue}.log", "wb")
    cmd = [sys.executable, "-m", "pagedq_cli", "serve", "--redis-url", redis_url]
    cmd += ["--queue", queue, "--port", str(port), "--log-level", "warning"]
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.1)
    raise TimeoutError("the gateway did not start")


async def gateway_ttfts(url: str, n: int, max_tokens: int, sdk: bool = False) -> list[float]:
    """Seconds to the first content chunk of n concurrent streamed chat requests, read with
    plain httpx (or OpenAI's SDK, which spends more of the caller's CPU per chunk)."""
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    http = httpx.AsyncClient(limits=limits, timeout=300)
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", http_client=http, max_retries=0)

    def body(i: int) -> dict:
        messages = [{"role": "user", "content": PROMPT.format(i=i)}]
        return {"model": "any", "messages": messages, "max_tokens": max_tokens, "temperature": 0}

    async def with_sdk(i: int) -> float:
        start, first = time.perf_counter(), None
        stream = await client.chat.completions.create(**body(i), stream=True)
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - start
        return first if first is not None else float("nan")

    async def with_httpx(i: int) -> float:
        start, first = time.perf_counter(), None
        request = {**body(i), "stream": True}
        async with http.stream("POST", url + "/v1/chat/completions", json=request) as r:
            async for line in r.aiter_lines():
                if first is None and '"content":"' in line and '"content":""' not in line:
                    first = time.perf_counter() - start
        return first if first is not None else float("nan")

    one = with_sdk if sdk else with_httpx
    try:
        return list(await asyncio.gather(*(one(i) for i in range(n))))
    finally:
        await http.aclose()


def client_ttfts(redis_url: str, n: int, max_tokens: int) -> list[float]:
    """The same requests through the Python client, one thread each (as n callers would)."""
    out = [float("nan")] * n
    barrier = threading.Barrier(n)

    def one(i: int) -> None:
        with Client(redis_url, QUEUE, check_interval=0.5) as client:
            barrier.wait()
            start = time.perf_counter()
            job = client.submit(
                messages=[{"role": "user", "content": PROMPT.format(i=i)}],
                max_tokens=max_tokens,
                temperature=0,
            )
            for delta in client.stream(job, timeout=300):
                if delta:
                    out[i] = time.perf_counter() - start
                    break
            client.result(job, timeout=300)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of the finite values."""
    xs = sorted(v for v in values if v == v)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def hold_idle(url: str, live_url: str, n: int, hold_s: float, pid: int) -> dict:
    """Open n idle streams on one gateway, hold them, measure, then close them all."""
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)
    http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(hold_s + OPEN_TIMEOUT_S + 60))
    body = {"model": "any", "messages": [{"role": "user", "content": "wait"}], "stream": True}
    opened = 0
    release = asyncio.Event()

    async def one() -> None:
        nonlocal opened
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            # The role chunk: the stream is open. (Leaving an `async for` over the lines
            # would close the response.)
            lines = r.aiter_lines()
            while not (await lines.__anext__()).startswith("data:"):
                pass
            opened += 1
            await release.wait()

    start = time.perf_counter()
    tasks = [asyncio.create_task(one()) for _ in range(n)]
    open_deadline = start + OPEN_TIMEOUT_S
    while opened < n and time.perf_counter() < open_deadline:
        await asyncio.sleep(0.1)
    open_s = time.perf_counter() - start
    held = opened
    await asyncio.sleep(hold_s)
    # Its own connection: the streams' pool queues requests behind the streams still opening.
    async with httpx.AsyncClient(timeout=30) as probe:
        gauge = _gauge(await probe.get(url + "/metrics"), "pagedq_gateway_open_streams")
        followed = (await probe.get(url + "/health")).json()["open_streams"]
    rss_mib = _rss_mib(pid)
    live = await gateway_ttfts(live_url, 1, 4)
    release.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    await http.aclose()
    return {
        "opened": held,
        "open_s": open_s,
        "gauge": gauge,
        "followed": followed,
        "rss_mib": rss_mib,
        "live": live,
    }


def run_batch(redis_url: str, url: str, logs: Path, n: int) -> dict:
    """Upload n lines and create the batch through a gateway that is then stopped; poll the
    batch to its end through another gateway (`url`)."""
    uploader, up_url = start_gateway(redis_url, QUEUE, logs)
    client = OpenAI(base_url=up_url + "/v1", api_key="none", timeout=600)
    lines = (
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "any",
                    "messages": [{"role": "user", "content": f"n {i}"}],
                    "max_tokens": 1,
                },
            }
        )
        + "\n"
        for i in range(n)
    )
    start = time.perf_counter()
    data = "".join(lines).encode()
    uploaded = client.files.create(file=("big.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    uploaded_s = time.perf_counter() - start
    uploader.terminate()  # the uploading side is gone from here on
    uploader.wait(15)
    other = OpenAI(base_url=url + "/v1", api_key="none")
    deadline = time.monotonic() + 1800
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        if time.monotonic() > deadline:
            break
        time.sleep(2)
        batch = other.batches.retrieve(batch.id)
    out_lines = 0
    if batch.output_file_id:
        out_lines = len(other.files.content(batch.output_file_id).text.splitlines())
    return {
        "lines": n,
        "bytes": len(data),
        "uploaded_s": uploaded_s,
        "total_s": time.perf_counter() - start,
        "status": batch.status,
        "counts": batch.request_counts,
        "output_lines": out_lines,
    }


def _gauge(response: httpx.Response, name: str) -> float:
    for line in response.text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return float("nan")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=200, help="concurrent streams per round")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of each path")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--idle", type=int, default=2000, help="idle streams to hold (<= 10000)")
    p.add_argument("--hold", type=float, default=10.0, help="seconds to hold them (<= 120)")
    p.add_argument(
        "--batch-lines",
        type=int,
        default=0,
        help="also run a batch of this many lines (<= 50000) uploaded through one gateway "
        "process that is then stopped, finished through another",
    )
    p.add_argument("--model", default=None, help="worker model (default: a tiny random Llama)")
    args = p.parse_args()
    args.idle = min(args.idle, 10_000)
    args.hold = min(args.hold, 120.0)

    with tempfile.TemporaryDirectory() as tmp, PrivateRedis() as server:
        logs = Path(tmp)
        model = args.model
        if model is None:
            from tiny_models import make_tiny_model

            model = str(make_tiny_model(logs / "tiny", "llama"))
        worker = WorkerProcess(
            server.url,
            QUEUE,
            "bench-gateway",
            logs,
            model=model,
            kv_cache_memory="256MiB",
            env={"OMP_NUM_THREADS": "1"},
        )
        gw, url = start_gateway(server.url, QUEUE, logs)
        idle_gw, idle_url = start_gateway(server.url, IDLE_QUEUE, logs)
        try:
            worker.wait_ready()
            asyncio.run(gateway_ttfts(url, 4, args.max_tokens))  # warm-up
            results: dict[str, list[float]] = {"gateway": [], "client": []}
            for _ in range(args.rounds):
                results["client"] += client_ttfts(server.url, args.streams, args.max_tokens)
                results["gateway"] += asyncio.run(gateway_ttfts(url, args.streams, args.max_tokens))
            idle = asyncio.run(hold_idle(idle_url, url, args.idle, args.hold, idle_gw.pid))
            batch = None
            if args.batch_lines:
                batch = run_batch(server.url, url, logs, min(args.batch_lines, 50_000))
        finally:
            for process in (gw, idle_gw):
                process.terminate()
                process.wait(15)
            worker.stop(timeout=15)

    print(
        f"TTFT, {args.streams} concurrent streams x {args.rounds} rounds, "
        f"{args.max_tokens} tokens each, model {args.model or 'tiny random Llama'}:"
    )
    print("| path | p50 s | p99 s |\n|---|---:|---:|")
    for name, values in results.items():
        print(f"| {name} | {percentile(values, 0.5):.3f} | {percentile(values, 0.99):.3f} |")
    ratio = percentile(results["gateway"], 0.5) / percentile(results["client"], 0.5)
    print(f"gateway / client p50: {ratio:.2f}")
    print(
        f"idle streams: {idle['opened']} of {args.idle} open in {idle['open_s']:.1f} s; after "
        f"{args.hold:.0f} s held: {idle['followed']} followed by the gateway's hub "
        f"({idle['gauge']:.0f} SSE streams), gateway RSS {idle['rss_mib']:.0f} MiB; a live "
        f"request on the other gateway meanwhile: first token in {idle['live'][0]:.3f} s"
    )
    _print_batch(batch)


def _print_batch(batch: dict | None) -> None:
    if batch is None:
        return
    c = batch["counts"]
    print(
        f"batch of {batch['lines']} lines ({batch['bytes'] / 2**20:.1f} MiB): uploaded and created "
        f"in {batch['uploaded_s']:.1f} s through a gateway then stopped; {batch['status']} after "
        f"{batch['total_s']:.0f} s through another, {c.completed} completed, {c.failed} failed, "
        f"{batch['output_lines']} output lines"
    )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
