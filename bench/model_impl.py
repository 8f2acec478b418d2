"""The Transformers modeling backend against pagedq's native families: same checkpoint, same
workload, one process.

    python bench/model_impl.py                        # a random llama, then a random qwen3_moe
    python bench/model_impl.py --tokens 64 --prompts 16 --dtype bfloat16

For each model (random checkpoints made once under ``--model-dir``): greedy generation of
``--prompts`` prompts x ``--tokens`` tokens with ``model_impl="native"`` and with
``"transformers"``, both engines built first and then timed in turns for ``--rounds`` rounds
after one untimed pass each (oneDNN builds its kernels per shape at first use); the best round
of each counts, as the machine is shared and noisy. Prints the tokens/s of each, the backend's
ratio, and how many tokens are equal (random weights have near-ties that summation order breaks
either way). Both paths share the paged attention kernels, the prepacked linears, the fused
experts and the LM head; the backend runs transformers' own norms, rotary and separate q/k/v and
gate/up projections.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bench.hybrid import checkpoint  # noqa: E402

MODELS = {
    "llama": dict(  # SmolLM2-135M's shape: 135M parameters, tied embeddings
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=4096, tie_word_embeddings=True,
    ),
    "qwen3_moe": dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
        max_position_embeddings=4096,
    ),
}  # fmt: skip
DEFAULT_DIR = Path.home() / ".cache" / "pagedq" / "bench" / "model_impl"


def engine(folder: Path, model_impl: str, dtype: str):
    """An engine on ``folder`` with ``model_impl``."""
    from engine import LLM

    return LLM(str(folder), dtype=dtype, model_impl=model_impl, kv_cache_memory="512MiB")


def timed(llm, prompts, tokens: int) -> tuple[float, list[list[int]]]:
    """(tokens/s, token ids) of one greedy pass over ``prompts``."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return len(prompts) * tokens / elapsed, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    prompts = [
        [(7 * i + j) % 5000 + 10 for j in range(48 + 8 * (i % 4))] for i in range(args.prompts)
    ]
    print(f"{args.prompts} prompts x {args.tokens} tokens, {args.dtype}, greedy, best of "
          f"{args.rounds} rounds")  # fmt: skip
    print("| model | native tok/s | transformers tok/s | ratio | tokens equal |")
    print("|---|---:|---:|---:|---|")
    for name in args.models:
        folder = checkpoint(args.model_dir / name, name, MODELS[name])
        llms = {impl: engine(folder, impl, args.dtype) for impl in ("native", "transformers")}
        best = dict.fromkeys(llms, 0.0)
        ids = {}
        for llm in llms.values():
            timed(llm, prompts, args.tokens)  # warm-up: every shape once
        for _ in range(args.rounds):
            for impl, llm in llms.items():
                rate, ids[impl] = timed(llm, prompts, args.tokens)
                best[impl] = max(best[impl], rate)
        native, backend = best["native"], best["transformers"]
        pairs = zip(ids["native"], ids["transformers"])
        same = sum(a == b for x, y in pairs for a, b in zip(x, y))
        print(
            f"| {name} | {native:.0f} | {backend:.0f} | {backend / native:.2f} | "
            f"{same} of {args.prompts * args.tokens} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
