"""Throughput: pagedq's continuous batching against Hugging Face static batching, same workload.

    python bench/throughput.py                      # the README's table: 256 requests
    python bench/throughput.py --num-requests 32 --max-output 64   # a quick look

Both run in this process on the same model, dtype and threads. Output lengths are forced with
``ignore_eos`` (pagedq) and ``min_new_tokens`` (Hugging Face), so both produce exactly the
requested tokens; static batching still computes each batch until its longest request ends.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

# The repo root first: bench/kernels.py must not shadow the kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WORDS = (
    "data model queue token batch cache paged block river mountain quiet green answer question "
    "system music history ocean planet garden letter window simple careful bright"
).split()


def make_workload(
    tokenizer,
    num_requests: int,
    min_prompt: int,
    max_prompt: int,
    min_output: int,
    max_output: int,
    seed: int,
):
    """Chat prompts of min..max tokens (template included) and output lengths, seeded."""
    rng = random.Random(seed)
    prompts, out_lens = [], []
    for _ in range(num_requests):
        target = rng.randint(min_prompt, max_prompt)
        words = []
        while True:
            msgs = [{"role": "user", "content": "Summarize: " + " ".join(words)}]
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            if len(ids) >= target:
                break
            words.extend(rng.choices(WORDS, k=max(1, (target - len(ids)) // 2)))
        prompts.append(ids)
        out_lens.append(rng.randint(min_output, max_output))
    return prompts, out_lens


def run_pagedq(llm, prompts, out_lens):
    from engine import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(out_lens)
    return tokens, elapsed


def run_hf_static(model, prompts, out_lens, batch_size: int, pad_id: int):
    from tqdm.auto import tqdm

    tokens, start = 0, time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch_size), desc="HF static batches"):
        batch, lens = prompts[i : i + batch_size], out_lens[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                pad_token_id=pad_id,
                max_new_tokens=max(lens),
                min_new_tokens=max(lens),
            )
        assert out.shape[1] - width == max(lens)
        tokens += sum(lens)  # only the tokens each request asked for are useful
    return tokens, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--min-prompt", type=int, default=20)
    ap.add_argument("--max-prompt", type=int, default=400)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=512)
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default="6GiB")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from engine import LLM
    from engine.model_loader import resolve_model

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
    )
    tok = llm.get_tokenizer()
    prompts, out_lens = make_workload(
        tok,
        args.num_requests,
        args.min_prompt,
        args.max_prompt,
        args.min_output,
        args.max_output,
        args.seed,
    )
    src = resolve_model(args.model)
    kwargs = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    hf = AutoModelForCausalLM.from_pretrained(
        src.folder, dtype=getattr(torch, args.dtype), **kwargs
    ).eval()
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0

    p_tokens, p_time = run_pagedq(llm, prompts, out_lens)
    stats = llm.stats
    h_tokens, h_time = run_hf_static(hf, prompts, out_lens, args.hf_batch_size, pad_id)
    p_rate, h_rate = p_tokens / p_time, h_tokens / h_time
    print(
        f"\nworkload: {args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt} "
        f"tokens (mean {sum(map(len, prompts)) / len(prompts):.0f}), outputs "
        f"{args.min_output}-{args.max_output} (total {sum(out_lens)}), {args.dtype}, "
        f"{torch.get_num_threads()} threads"
    )
    print("| engine | output tokens | seconds | output tokens/s |")
    print("|---|---:|---:|---:|")
    print(
        f"| HF static batching (batch {args.hf_batch_size}) | {h_tokens} | {h_time:.1f} | "
        f"{h_rate:.1f} |"
    )
    print(f"| pagedq continuous batching | {p_tokens} | {p_time:.1f} | {p_rate:.1f} |")
    print(
        f"\nspeed-up: {p_rate / h_rate:.2f}x   (pagedq: {stats.num_steps} steps, "
        f"{stats.num_preemptions} preemptions, prefix-cache hit rate "
        f"{stats.prefix_cache_hit_rate:.1%})"
    )


if __name__ == "__main__":
    main()
