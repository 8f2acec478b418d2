"""Tensor parallel on this host: one rank against two, same model, same batch, one process.

    python bench/parallel.py                       # a random llama, then a random qwen3_moe
    python bench/parallel.py --tokens 64 --prompts 16

For each model (random checkpoints made once under ``--model-dir``, fp32): greedy generation of
``--prompts`` prompts x ``--tokens`` tokens at ``tensor_parallel_size=1`` with every core, then
at 2 with the cores split between the ranks (one thread each on a 2-core host); prints the
tokens/s of each, their ratio, how many tokens are equal (random weights have near-ties that
summation order breaks either way), and the weight bytes rank 0 holds
(parameters and packed experts) against the whole model's. On CPUs the two ranks share the
socket's memory bandwidth, so the ratio says what splitting costs here (gloo's all-reduces per
layer), not what it gains on GPUs. The machine is shared and noisy: compare ratios of one run.
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
    "llama": dict(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=4096,
    ),
    "qwen3_moe": dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
        max_position_embeddings=4096,
    ),
}  # fmt: skip
DEFAULT_DIR = Path.home() / ".cache" / "pagedq" / "bench" / "parallel"


def fresh_model(folder: Path):
    """The whole model as loaded, before any packing for the CPU."""
    import torch

    from engine.model_loader import load_model

    return load_model.__wrapped__(str(folder), torch.float32, torch.device("cpu"), "auto")[0]


def run(folder: Path, ranks: int, prompts, tokens: int):
    """(tokens/s, token ids, rank 0's weight bytes) at ``ranks`` ranks."""
    from engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    with LLM(str(folder), dtype="float32", tensor_parallel_size=ranks) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        held = llm.llm_engine.model.weight_bytes()
    ids = [o.outputs[0].token_ids for o in outs]
    return len(prompts) * tokens / elapsed, ids, held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    prompts = [
        [(7 * i + j) % 5000 + 10 for j in range(48 + 8 * (i % 4))] for i in range(args.prompts)
    ]
    print(f"{args.prompts} prompts x {args.tokens} tokens, fp32, greedy")
    print("| model | 1 rank tok/s | 2 ranks tok/s | ratio | tokens equal | rank 0 weights |")
    print("|---|---:|---:|---:|---|---:|")
    for name in args.models:
        folder = checkpoint(args.model_dir / name, name, MODELS[name])
        one, ids1, _ = run(folder, 1, prompts, args.tokens)
        whole = fresh_model(folder).weight_bytes()  # unpacked: one rank packs its linears
        two, ids2, held = run(folder, 2, prompts, args.tokens)
        same = sum(a == b for x, y in zip(ids1, ids2) for a, b in zip(x, y))
        print(
            f"| {name} | {one:.0f} | {two:.0f} | {two / one:.2f} | {same} of "
            f"{args.prompts * args.tokens} | "
            f"{held / whole:.2f} of {whole / 2**20:.0f} MiB |"
        )


if __name__ == "__main__":
    main()
