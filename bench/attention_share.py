"""Attention's share of a whole offline run, step by step (the goal: <= 20% on the mixed workload).

    python bench/attention_share.py                            # mixed: 96 requests, fp32 cache
    python bench/attention_share.py --kv-cache-dtype bfloat16  # half the K/V bytes
    python bench/attention_share.py --dtype bfloat16           # a bf16 model (auto with AMX)
    python bench/attention_share.py --workload uniform

Steps ``LLMEngine`` in this process over one workload of ``bench/peers.py`` (greedy,
``ignore_eos``) with every layer's attention call (``write_kv`` + ``unified_attention``) timed,
and prints attention's share of the run, of the decode-only steps and of the steps with prompt
chunks, then the decode steps by batch size with the rate at which attention went through the
K/V it had to read (keys x K/V bytes per key and layer / attention time): the number to hold
against what the machine streams. Like bench/peers.py's children it pins its OpenMP threads
one per core (it starts itself again with them pinned, unless GOMP_CPU_AFFINITY or
OMP_NUM_THREADS is set); the timers add a few microseconds per layer.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))  # first: bench/kernels.py must not shadow the kernels package


def pin_threads() -> None:
    """Start again with the OpenMP threads pinned (libgomp reads the variables at load)."""
    if os.environ.get("GOMP_CPU_AFFINITY") or os.environ.get("OMP_NUM_THREADS"):
        return
    from engine.cpu_threads import bind_env

    env = bind_env()
    if env:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})


def main() -> None:
    pin_threads()
    import peers
    from roofline import AttentionTimer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=sorted(peers.WORKLOADS), default="mixed")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.quick, args.num_requests = False, None  # what peers.make_work reads

    from engine import LLM, SamplingParams

    work = peers.make_work(args, args.workload)
    llm = LLM(
        args.model, dtype=args.dtype, max_num_seqs=256, max_num_batched_tokens=2048,
        kv_cache_memory="4GiB", kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    llm.generate(work["prompts"][:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    engine = llm.llm_engine
    for i, (prompt, n) in enumerate(zip(work["prompts"], work["out_lens"])):
        engine.add_request(
            str(i), prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        )

    caches = engine.kv_caches  # per layer [2, blocks, block_size, kv_heads, head_dim]
    key_bytes = len(caches) * caches[0][:, 0, 0].numel() * caches[0].element_size()
    steps = []  # (seconds, attention seconds, has prompt chunks, requests, keys read)
    start = time.perf_counter()
    with AttentionTimer(engine.model) as attention:
        while engine.has_unfinished_requests():
            before, t = attention.seconds, time.perf_counter()
            engine.step()
            out = engine.scheduler.last_output
            keys = sum(s.request.num_computed_tokens for s in out.scheduled)
            steps.append((time.perf_counter() - t, attention.seconds - before,
                          out.num_prefill_tokens > 0, len(out.scheduled), keys))  # fmt: skip
    total = time.perf_counter() - start

    tokens = sum(work["out_lens"])
    spent = sum(s[1] for s in steps)
    print(f"\n{args.workload}: {len(work['prompts'])} requests, {tokens} output tokens, "
          f"dtype={args.dtype}, kv_cache_dtype={args.kv_cache_dtype}: {total:.1f} s, "
          f"{tokens / total:.1f} tokens/s, "
          f"attention {spent:.1f} s = {100 * spent / total:.1f}% of the run")  # fmt: skip
    for label, prefill in (("decode-only steps", False), ("steps with prompt chunks", True)):
        chosen = [s for s in steps if s[2] == prefill]
        seconds = sum(s[0] for s in chosen)
        share = 100 * sum(s[1] for s in chosen) / max(seconds, 1e-9)
        print(f"{label}: {len(chosen)}, {seconds:.1f} s ({100 * seconds / total:.0f}% of the run), "
              f"attention {share:.0f}% of them")  # fmt: skip
    buckets = defaultdict(lambda: [0, 0.0, 0.0, 0, 0])
    for seconds, att, prefill, requests, keys in steps:
        if not prefill:
            b = buckets[requests // 16 * 16]
            b[0], b[1], b[2], b[3], b[4] = (
                b[0] + 1,
                b[1] + seconds,
                b[2] + att,
                b[3] + keys,
                b[4] + requests,
            )
    print("\n| decode batch | steps | ms per step | attention share | mean context | K/V read |")
    print("|---|---:|---:|---:|---:|---:|")
    for low in sorted(buckets):
        n, seconds, att, keys, requests = buckets[low]
        rate = keys * key_bytes / max(att, 1e-9) / 1e9
        print(f"| {low}-{low + 15} | {n} | {1e3 * seconds / n:.0f} | {100 * att / seconds:.0f}% | "
              f"{keys / requests:.0f} | {rate:.1f} GB/s |")  # fmt: skip


if __name__ == "__main__":
    main()
