"""`pagedq diagnose` against a real worker forced into memory pressure (a tiny KV cache)."""

from __future__ import annotations

import time

from worker_process import WorkerProcess

from producer.client import Client
from producer.diagnose import collect, diagnose

QUEUE = "pressure"
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # tiny Llama: layers * (k, v) * block * kv_heads * dim * 4


def test_diagnose_names_memory_pressure_of_a_real_worker(
    redis_server, redis_client, tiny_llama_dir, tmp_path
):
    # 24 blocks of 16 tokens; each job alone grows to 20 of them: the batch is memory bound.
    worker = WorkerProcess(
        redis_server.url,
        QUEUE,
        "tiny-kv",
        tmp_path,
        "--max-num-seqs",
        "8",
        model=tiny_llama_dir,
        kv_cache_memory=str(24 * BLOCK_BYTES),
        lease_ttl=3,
        env={"OMP_NUM_THREADS": "1"},
    )
    try:
        worker.wait_ready(timeout=120)
        client = Client(redis_server.url, QUEUE)
        client.submit_many(
            [{"prompt": [5 + i] * 20, "max_tokens": 300, "ignore_eos": True} for i in range(8)]
        )
        deadline, kinds = time.monotonic() + 120, []
        while time.monotonic() < deadline:
            workers, lengths = collect(redis_client, QUEUE)
            findings = diagnose(workers, lengths)
            kinds = [f.kind for f in findings]
            if "memory_pressure" in kinds:
                break
            time.sleep(0.5)
        assert "memory_pressure" in kinds, (kinds, workers, worker.log_tail())
        pressure = next(f for f in findings if f.kind == "memory_pressure")
        assert pressure.worker == "tiny-kv" and "--kv-cache-memory" in pressure.setting
    finally:
        worker.kill()
