"""Per-layer attention on the CPU: the torch reference against the C++ kernel, same inputs.

    python bench/attention_cpu.py                  # SmolLM2-135M shapes, fp32, all threads
    python bench/attention_cpu.py --threads 1 --repeats 20
    python bench/attention_cpu.py --engine         # end to end: the engine on each backend

For each batch it times one layer's ``write_kv`` + ``unified_attention`` (what the model calls per
layer) with the torch reference and with the C++ kernels (fp32 cache, and a bf16 cache under the
fp32 model, i.e. ``kv_cache_dtype="bfloat16"``), interleaving the backends so that a noisy machine
hits them alike, and prints medians, ratios and the time of 30 layers. It also prints the time of
a plain sum over the batch's K/V bytes: the memory-streaming floor of a decode.

``--layers 30`` gives each backend 30 copies of the cache, one per model layer, and cycles
through them: the K/V then comes from DRAM, as in the engine, instead of a last-level cache that
holds one layer's whole cache (260 MB of L3 on one development VM made the kernel look 1.3-2x
faster than it runs inside a model).

``--engine`` runs one workload of ``bench/throughput.py`` (greedy, ``ignore_eos``) through the
offline engine with ``attention_backend="torch"``, ``"cpu"``, and ``"cpu"`` with
``kv_cache_dtype="bfloat16"``, in rounds that alternate the backends, and prints output tokens/s
and the ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

# The repo root first: bench/kernels.py must not shadow the kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # bench/throughput.py's workload


def paged_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, seed):
    """Inputs of one layer's call, blocks shuffled over a pool with room to spare."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 8
    physical = torch.randperm(num_blocks, generator=gen)
    block_table = torch.full((len(seq_lens), max(blocks)), -1, dtype=torch.long)
    used = 0
    for i, n in enumerate(blocks):
        block_table[i, :n] = physical[used : used + n]
        used += n
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(shape, generator=gen)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn_like(key)
    slots = []
    for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        slots += [int(block_table[i, p // block_size]) * block_size + p % block_size
                  for p in range(s - q, s)]  # fmt: skip
    return {
        "query": query, "key": key, "value": value, "kv_cache": kv_cache,
        "slot_mapping": torch.tensor(slots), "seq_lens": torch.tensor(seq_lens),
        "query_start_loc": torch.tensor([0, *query_lens]).cumsum(0),
        "block_table": block_table, "scale": head_dim**-0.5,
        "kv_bytes": 2 * sum(seq_lens) * num_kv_heads * head_dim * 4,
    }  # fmt: skip


def workloads(seed: int) -> dict[str, tuple[list[int], list[int]]]:
    """(query_lens, context_lens) of issue 8's three batches, and a pure prefill."""
    rng = random.Random(seed)
    # A step of the mixed run: 96 running requests (prompts 20-400 tokens, some output so far),
    # 90 of them decoding and 6 prompts being prefilled whole.
    prompts = [rng.randint(20, 400) for _ in range(96)]
    decode_ctx = [p + rng.randint(0, 256) for p in prompts[:90]]
    mixed = ([1] * 90 + prompts[90:], decode_ctx + [0] * 6)
    return {
        "64 decodes x 512": ([1] * 64, [511] * 64),
        "6 prompts x 300 (prefill)": ([300] * 6, [0] * 6),
        "mixed 96 (prompts 20-400)": mixed,
        "256 decodes x 512": ([1] * 256, [511] * 256),
    }


def run_layer(backend: str, b: dict, kv_cache: torch.Tensor, plan=None) -> None:
    from kernels import unified_attention, write_kv

    write_kv(b["key"], b["value"], kv_cache, b["slot_mapping"], backend=backend)
    unified_attention(
        b["query"], kv_cache, b["query_start_loc"], b["seq_lens"], b["block_table"], b["scale"],
        backend=backend, plan=plan,
    )  # fmt: skip


def engine_main(args) -> int:
    """Output tokens/s of the same workload on each attention backend, alternating in rounds."""
    from throughput import make_workload

    from engine import LLM, SamplingParams

    configs = {
        "torch": {"attention_backend": "torch"},
        "cpu": {"attention_backend": "cpu"},
        "cpu + bf16 KV": {"attention_backend": "cpu", "kv_cache_dtype": "bfloat16"},
    }
    llms = {
        name: LLM(
            "smollm2", dtype="float32", max_num_seqs=args.max_num_seqs,
            kv_cache_memory=args.kv_cache_memory, **kw,
        )
        for name, kw in configs.items()
    }  # fmt: skip
    tok = next(iter(llms.values())).get_tokenizer()
    prompts, out_lens = make_workload(
        tok, args.num_requests, args.min_prompt, args.max_prompt, args.min_output,
        args.max_output, args.seed,
    )  # fmt: skip
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    elapsed = {name: 0.0 for name in llms}
    outputs = {}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed[name] += time.perf_counter() - start
            outputs[name] = [o.outputs[0].token_ids for o in outs]
    tokens = args.rounds * sum(out_lens)
    print(f"{args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt}, outputs "
          f"{args.min_output}-{args.max_output}, fp32, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds")  # fmt: skip
    base = tokens / elapsed["torch"]
    for name in llms:
        rate = tokens / elapsed[name]
        same = sum(a == b for a, b in zip(outputs[name], outputs["torch"]))
        print(f"{name:<16} {rate:>8.1f} output tokens/s  {rate / base:>5.2f}x of torch  "
              f"({same}/{len(prompts)} outputs identical to torch's)")  # fmt: skip
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="store_true", help="end to end, see the docstring")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--min-prompt", type=int, default=20)
    parser.add_argument("--max-prompt", type=int, default=400)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=96)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--layers", type=int, default=1,
        help="distinct caches cycled through, one per layer (30: DRAM-cold, as in the model)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall",
        help="cpu: the process's CPU time, steadier than wall time on a shared machine",
    )  # fmt: skip
    args = parser.parse_args()
    if args.engine:
        return engine_main(args)
    from kernels import plan_attention
    from kernels.cpu_attention import cpu_kernels_available

    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_kernels_available():
        print("the C++ CPU kernels are unavailable here: nothing to compare")
        return 1
    print(f"SmolLM2-135M attention shapes (9 heads, 3 KV heads, head_dim 64), block size "
          f"{args.block_size}, fp32 model, {torch.get_num_threads()} threads; per layer, medians "
          f"of {args.repeats}, {args.clock} clock, {args.layers} layer cache(s)")  # fmt: skip
    print(f"{'batch':<28} {'torch ms':>9} {'cpu ms':>8} {'cpu bf16kv':>11} {'ratio':>6} "
          f"{'bf16/fp32':>9} {'sum(K/V) ms':>11} {'30 layers cpu':>14}")  # fmt: skip
    for name, (query_lens, context_lens) in workloads(args.seed).items():
        b = paged_batch(query_lens, context_lens, 9, 3, 64, args.block_size, args.seed)
        kv_fp32 = [b["kv_cache"]] + [b["kv_cache"].clone() for _ in range(args.layers - 1)]
        kv_bf16 = [kv.to(torch.bfloat16) for kv in kv_fp32]
        # The reference's plan is built once per step and shared by every layer, as in the engine.
        plan = plan_attention(
            "torch", b["query_start_loc"], b["seq_lens"], b["block_table"], args.block_size
        )
        runs = {
            "torch": lambda b=b, p=plan, kv=kv_fp32: [run_layer("torch", b, c, p) for c in kv],
            "cpu": lambda b=b, kv=kv_fp32: [run_layer("cpu", b, c) for c in kv],
            "cpu bf16kv": lambda b=b, kv=kv_bf16: [run_layer("cpu", b, c) for c in kv],
            "sum": lambda kv=kv_fp32: [c.sum() for c in kv],
        }
        times: dict[str, list[float]] = {k: [] for k in runs}
        for fn in runs.values():
            fn()  # warm-up
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        for _ in range(args.repeats):
            for key, fn in runs.items():
                start = clock()
                fn()
                times[key].append((clock() - start) * 1e3 / args.layers)
        ms = {k: statistics.median(v) for k, v in times.items()}
        # sum() reads the whole pool; scale to the bytes the batch needs.
        floor = ms["sum"] * b["kv_bytes"] / (kv_fp32[0].numel() * 4)
        print(f"{name:<28} {ms['torch']:>9.2f} {ms['cpu']:>8.2f} {ms['cpu bf16kv']:>11.2f} "
              f"{ms['torch'] / ms['cpu']:>5.1f}x {ms['cpu bf16kv'] / ms['cpu']:>9.2f} "
              f"{floor:>11.2f} {30 * ms['cpu']:>11.0f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
