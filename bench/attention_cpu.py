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

``--dtype bfloat16`` runs the model in bf16 (bf16 queries, K/V and cache); ``--head-major`` lays
the caches out as the engine allocates them for the C++ kernels (head-major blocks, on huge
pages); ``--decodes 64x128,96x512`` replaces the batches with pure decodes of those sizes and
contexts; ``--amx`` adds a column of the C++ kernel with AMX turned off (``PAGEDQ_CPU_AMX=0``,
read at each call), timed in the same rounds, and the ratio of the two. ``GB/s`` is the rate the
C++ kernel read the batch's K/V at.

``--against main`` builds the C++ attention of that git revision beside this tree's
(``bench/kernel_revision.py``) and times it in the same rounds: the ``rev ms`` column and
``cpu/rev``, the ratio a kernel change is judged by. ``--sliding-window 512`` adds the C++
kernel with that window on every layer (``window ms``, ``window/cpu``): on long decodes
(``--decodes 16x8192``) it reads the window's blocks only.

``--engine`` runs one workload of ``bench/throughput.py`` (greedy, ``ignore_eos``) through the
offline engine with ``attention_backend="torch"``, ``"cpu"``, and ``"cpu"`` with
``kv_cache_dtype="bfloat16"``, in rounds that alternate the backends, and prints output tokens/s
and the ratios.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

# The repo root first: bench/kernels.py must not shadow the kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # bench/throughput.py's workload


def paged_batch(
    query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, seed,
    dtype=torch.float32,
):  # fmt: skip
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
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
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
        "kv_bytes": 2 * sum(seq_lens) * num_kv_heads * head_dim * dtype.itemsize,
    }  # fmt: skip


def engine_layout(kv_cache: torch.Tensor) -> torch.Tensor:
    """A copy of a cache laid out as ``allocate_kv_cache`` does for the C++ kernels."""
    from kernels.huge_pages import zeros_huge

    two, blocks, block_size, heads, dim = kv_cache.shape
    out = zeros_huge((two, blocks, heads, block_size, dim), kv_cache.dtype).transpose(2, 3)
    return out.copy_(kv_cache)


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


def run_layer(backend: str, b: dict, kv_cache: torch.Tensor, plan=None, **options) -> None:
    from kernels import unified_attention, write_kv

    write_kv(b["key"], b["value"], kv_cache, b["slot_mapping"], backend=backend)
    unified_attention(
        b["query"], kv_cache, b["query_start_loc"], b["seq_lens"], b["block_table"], b["scale"],
        backend=backend, plan=plan, **options,
    )  # fmt: skip


def run_layer_revision(attend, b: dict, kv_cache: torch.Tensor) -> None:
    """``run_layer("cpu", ...)`` with another revision's attention (``--against``)."""
    from kernels import write_kv

    write_kv(b["key"], b["value"], kv_cache, b["slot_mapping"], backend="cpu")
    out = torch.empty_like(b["query"])
    attend(b["query"], kv_cache, b["query_start_loc"], b["seq_lens"], b["block_table"],
           b["scale"], out)  # fmt: skip


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
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--head-major", action="store_true", help="caches laid out as the engine's")
    parser.add_argument("--decodes", default="", help="pure decode batches, e.g. 64x128,96x512")
    parser.add_argument("--amx", action="store_true", help="add the C++ kernel without AMX")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch reference")
    parser.add_argument("--against", default="", help="a git revision's C++ attention, timed too")
    parser.add_argument("--sliding-window", type=int, default=0, help="add the C++ kernel with it")
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
    dtype = getattr(torch, args.dtype)
    revision = None
    if args.against:
        from kernel_revision import load_revision_attention

        revision = load_revision_attention(args.against)
    print(f"SmolLM2-135M attention shapes (9 heads, 3 KV heads, head_dim 64), block size "
          f"{args.block_size}, {args.dtype} model, {torch.get_num_threads()} threads; per layer, "
          f"medians of {args.repeats}, {args.clock} clock, {args.layers} layer cache(s)"
          f"{', head-major caches' if args.head_major else ''}")  # fmt: skip
    print(f"{'batch':<28} {'torch ms':>9} {'cpu ms':>8} {'cpu bf16kv':>11} {'ratio':>6} "
          f"{'bf16/fp32':>9} {'sum(K/V) ms':>11} {'30 layers cpu':>14} {'GB/s':>6}"
          f"{'  no-AMX ms  AMX/no-AMX' if args.amx else ''}"
          f"{'   rev ms  cpu/rev' if revision else ''}"
          f"{'  window ms  window/cpu' if args.sliding_window else ''}")  # fmt: skip
    batches = workloads(args.seed)
    if args.decodes:
        batches = {}
        for spec in args.decodes.split(","):
            size, context = (int(x) for x in spec.split("x"))
            batches[f"{size} decodes x {context}"] = ([1] * size, [context - 1] * size)
    for name, (query_lens, context_lens) in batches.items():
        b = paged_batch(query_lens, context_lens, 9, 3, 64, args.block_size, args.seed, dtype)
        kv_fp32 = [b["kv_cache"]] + [b["kv_cache"].clone() for _ in range(args.layers - 1)]
        kv_bf16 = [kv.to(torch.bfloat16) for kv in kv_fp32]
        if args.head_major:  # as allocate_kv_cache: head-major blocks, on huge pages
            kv_fp32, kv_bf16 = ([engine_layout(kv) for kv in kvs] for kvs in (kv_fp32, kv_bf16))
        kv_model = kv_bf16 if dtype == torch.bfloat16 else kv_fp32
        # The reference's plan is built once per step and shared by every layer, as in the engine.
        plan = plan_attention(
            "torch", b["query_start_loc"], b["seq_lens"], b["block_table"], args.block_size
        )
        runs = {
            "torch": lambda b=b, p=plan, kv=kv_model: [run_layer("torch", b, c, p) for c in kv],
            "cpu": lambda b=b, kv=kv_model: [run_layer("cpu", b, c) for c in kv],
            "cpu bf16kv": lambda b=b, kv=kv_bf16: [run_layer("cpu", b, c) for c in kv],
            "sum": lambda kv=kv_model: [c.sum() for c in kv],
        }
        if args.no_torch:
            del runs["torch"]
        if dtype == torch.bfloat16:
            del runs["cpu bf16kv"]  # the model's own cache is bf16
        if args.amx:
            runs["no-AMX"] = runs["cpu"]
        if revision is not None:
            runs["rev"] = lambda b=b, kv=kv_model: [run_layer_revision(revision, b, c) for c in kv]
        if args.sliding_window:
            window = args.sliding_window
            runs["window"] = lambda b=b, kv=kv_model, w=window: [
                run_layer("cpu", b, c, sliding_window=w) for c in kv
            ]
        times: dict[str, list[float]] = {k: [] for k in runs}
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        for rep in range(args.repeats + 1):  # the first round warms up
            for key, fn in runs.items():
                os.environ["PAGEDQ_CPU_AMX"] = "0" if key == "no-AMX" else "1"
                start = clock()
                fn()
                if rep:
                    times[key].append((clock() - start) * 1e3 / args.layers)
        os.environ.pop("PAGEDQ_CPU_AMX", None)
        ms = {k: statistics.median(v) for k, v in times.items()}
        nan = float("nan")
        torch_ms, bf16_ms = ms.get("torch", nan), ms.get("cpu bf16kv", nan)
        # sum() reads the whole pool; scale to the bytes the batch needs.
        floor = ms["sum"] * b["kv_bytes"] / (kv_model[0].numel() * kv_model[0].itemsize)
        rate = b["kv_bytes"] / ms["cpu"] / 1e6
        line = (f"{name:<28} {torch_ms:>9.2f} {ms['cpu']:>8.2f} {bf16_ms:>11.2f} "
                f"{torch_ms / ms['cpu']:>5.1f}x {bf16_ms / ms['cpu']:>9.2f} "
                f"{floor:>11.2f} {30 * ms['cpu']:>11.0f} ms {rate:>6.1f}")  # fmt: skip
        if args.amx:
            line += f"  {ms['no-AMX']:>9.3f}  {ms['cpu'] / ms['no-AMX']:>10.3f}"
        if revision is not None:
            line += f"  {ms['rev']:>7.3f}  {ms['cpu'] / ms['rev']:>7.3f}"
        if args.sliding_window:
            line += f"  {ms['window']:>9.3f}  {ms['window'] / ms['cpu']:>10.3f}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
