"""Embeddings: pagedq's `LLM.embed` against Hugging Face's `AutoModel` on the same prompts.

    python bench/embed.py                       # 64 prompts of 20-300 tokens, smollm2, fp32
    python bench/embed.py --num-prompts 16      # a quick look

Both pool the last token's final hidden state and normalise it. Hugging Face runs padded
batches of `--hf-batch` prompts sorted by length (its best case: little padding), pagedq one
`embed` call (continuous batching, no padding). Prints prompt tokens/s of each, their ratio,
and the largest difference between the two sets of vectors. The two run in turns, `--rounds`
times; the ratio of every round is printed (the machine is shared: compare within one run).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import LLM  # noqa: E402
from engine.model_loader import cached_source, resolve_model  # noqa: E402


def prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    """`n` token-id prompts of 20-300 tokens from a fixed text."""
    rng = random.Random(seed)
    words = ("the quick brown fox jumps over a lazy dog while pagedq embeds text " * 40).split()
    out = []
    for _ in range(n):
        ids = tokenizer.encode(" ".join(rng.choice(words) for _ in range(300)))
        out.append(ids[: rng.randint(20, 300)])
    return out


def hf_embed(model, batches: list[list[list[int]]]) -> list[torch.Tensor]:
    """Last-token pooled, normalised vectors, right-padded batches."""
    vectors = []
    with torch.inference_mode():
        for batch in batches:
            longest = max(map(len, batch))
            ids = torch.tensor([p + [0] * (longest - len(p)) for p in batch])
            mask = torch.tensor([[1] * len(p) + [0] * (longest - len(p)) for p in batch])
            states = model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = torch.tensor([len(p) - 1 for p in batch])
            pooled = states[torch.arange(len(batch)), last]
            vectors += list(torch.nn.functional.normalize(pooled, dim=-1))
    return vectors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import AutoModel

    llm = LLM(args.model, dtype="float32", max_num_batched_tokens=2048)
    data = prompts(llm.get_tokenizer(), args.num_prompts, args.seed)
    folder = cached_source(resolve_model(args.model)).folder
    hf = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    order = sorted(range(len(data)), key=lambda i: len(data[i]))
    batches = [
        [data[i] for i in order[k : k + args.hf_batch]] for k in range(0, len(order), args.hf_batch)
    ]
    num_tokens = sum(map(len, data))
    llm.embed(data[:2], pooling="last", use_tqdm=False)  # warm-up: packing, first-call costs
    hf_embed(hf, [batches[0][:2]])
    ratios = []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        ours = llm.embed(data, pooling="last", use_tqdm=False)
        t_ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        theirs = hf_embed(hf, batches)
        t_hf = time.perf_counter() - t0
        ratio = t_hf / t_ours
        ratios.append(ratio)
        by_input = {order[k]: v for k, v in enumerate(theirs)}
        diff = max(
            float((torch.tensor(o.outputs[0].embedding) - by_input[i]).abs().max())
            for i, o in enumerate(ours)
        )
        print(
            f"round {r}: {num_tokens} prompt tokens; pagedq {num_tokens / t_ours:.0f} tok/s, "
            f"HF {num_tokens / t_hf:.0f} tok/s, pagedq / HF {ratio:.2f}; max |diff| {diff:.2e}"
        )
    print(f"pagedq / HF prompt tokens/s by round: {', '.join(f'{x:.2f}' for x in ratios)}")


if __name__ == "__main__":
    main()
