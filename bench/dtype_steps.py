"""A decode step in fp32 and in bf16 (prepacked, and on plain ``F.linear``), in one process.

    python bench/dtype_steps.py                     # batches 64 128, context 512
    python bench/dtype_steps.py --batches 64 --repeats 7

Three engines of the same model share the process: fp32 (prepacked, the default), bf16 as the
engine runs it, and bf16 with ``PAGEDQ_PREPACK=0`` (plain ``F.linear``, as the engine ran bf16
without AMX before its bf16 weights were packed widened to fp32). Each holds ``batch`` requests
at ``context`` tokens (bench/roofline.py's set-up), and their steps take turns, so the host's
load weighs on all three alike. Prints each step's median and its ratio to the fp32 step.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from roofline import interleaved_medians, kv_bytes_per_token, start_decodes  # noqa: E402

VARIANTS = {  # name: (dtype, PAGEDQ_PREPACK)
    "fp32": ("float32", "1"),
    "bf16": ("bfloat16", "1"),
    "bf16 plain": ("bfloat16", "0"),
}


def build(model: str, dtype: str, prepack: str, tokens: int, max_batch: int):
    """One engine with room for ``tokens`` KV slots, packed or not as ``prepack`` says."""
    from engine import LLMEngine
    from engine.model_loader import load_model

    os.environ["PAGEDQ_PREPACK"] = prepack
    load_model.cache_clear()  # a cached model may already be packed (or not)
    probe = LLMEngine(model=model, dtype=dtype, kv_cache_memory="16MiB", max_num_seqs=1)
    per_token = kv_bytes_per_token(probe)
    del probe
    load_model.cache_clear()
    engine = LLMEngine(
        model=model, dtype=dtype, max_num_seqs=max_batch, kv_cache_memory=tokens * per_token
    )
    for cache in engine.kv_caches:
        cache.normal_()  # touch every page: zero pages would make attention look cheap
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    max_batch = max(args.batches)
    tokens = max_batch * (args.context + args.repeats + 2 + 16)
    engines = {
        name: build(args.model, dtype, prepack, tokens, max_batch)
        for name, (dtype, prepack) in VARIANTS.items()
    }
    rows = []
    for batch in args.batches:
        ids = {}
        for name, engine in engines.items():
            vocab = engine.hf_config.vocab_size
            ids[name] = start_decodes(engine, batch, args.context, vocab)
            engine.step()  # the first step after admission
        steps = {name: engine.step for name, engine in engines.items()}
        rows.append((batch, interleaved_medians(steps, args.repeats)))
        for name, engine in engines.items():
            for rid in ids[name]:
                engine.abort_request(rid)

    print(
        f"\ndecode step by dtype: {args.model}, context {args.context}, "
        f"{torch.get_num_threads()} threads, load average "
        f"{open('/proc/loadavg').read().split()[0]}"
    )
    print("| batch | " + " | ".join(f"{n} ms" for n in VARIANTS) + " | "
          + " | ".join(f"{n} / fp32" for n in list(VARIANTS)[1:]) + " |")  # fmt: skip
    print("|---:" * (2 * len(VARIANTS)) + "|")
    for batch, times in rows:
        ms = " | ".join(f"{times[n] * 1e3:.1f}" for n in VARIANTS)
        ratios = " | ".join(f"{times[n] / times['fp32']:.2f}" for n in list(VARIANTS)[1:])
        print(f"| {batch} | {ms} | {ratios} |")


if __name__ == "__main__":
    main()
