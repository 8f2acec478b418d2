"""Decode speed of 4-bit weight-only checkpoints against bf16 and fp32 on this CPU, one process.

    python bench/quantized.py                      # a random ~0.5 B llama, 8 prompts x 64 tokens
    python bench/quantized.py --prompts 1 --tokens 32

A random llama (``--layers`` x ``--hidden``; weights dominate its decode step) is written once
under ``--model-dir`` as GPTQ (4 bits, group 128, act order off) and AWQ (4 bits, group 128), with
the plain checkpoint of the same weights dequantized (``tests/quantized_checkpoints.py``). Each
is generated greedily at batch ``--prompts``: the GPTQ and AWQ folders in bf16 (activations bf16,
weights packed), the plain one in bf16 and in fp32, all loaded at once and run in ``--rounds``
alternating rounds. Prints each one's best decode tokens/s (generated tokens over the time after
the first token), its ratio to bf16, and the weights' bytes. The machine is shared and noisy:
compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

DEFAULT_DIR = Path.home() / ".cache" / "pagedq" / "bench" / "quantized"


def checkpoints(folder: Path, layers: int, hidden: int) -> dict[str, Path]:
    """The GPTQ, AWQ and plain folders of one random llama, written once."""
    import torch

    done = folder / "complete"
    paths = {name: folder / name for name in ("gptq", "awq", "plain", "plain-awq")}
    if done.exists():
        return paths
    from quantized_checkpoints import write_awq, write_gptq
    from tiny_models import default_tokenizer, tiny_hf_model

    model = tiny_hf_model(
        "llama", vocab_size=len(default_tokenizer()), hidden_size=hidden,
        intermediate_size=hidden * 4, num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256), tie_word_embeddings=True,
        max_position_embeddings=4096,
    )  # fmt: skip
    with torch.no_grad():  # a trained model's scale: the default init's, not the tests' wide one
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    write_gptq(model, paths["gptq"], paths["plain"], group_size=128)
    write_awq(model, paths["awq"], paths["plain-awq"], group_size=128)
    done.write_text("ok\n")
    return paths


def decode_speed(llm, prompts, tokens: int) -> float:
    """Decode tokens/s of one greedy generation: the time after each prompt's first token."""
    from engine import SamplingParams

    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, first, use_tqdm=False)
    prefill = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return len(prompts) * (tokens - 1) / (time.perf_counter() - start - prefill)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    paths = checkpoints(
        args.model_dir / f"llama-{args.layers}x{args.hidden}", args.layers, args.hidden
    )
    prompts = [[(13 * i + j) % 5000 + 10 for j in range(32)] for i in range(args.prompts)]
    runs = [("bf16", "plain", "bfloat16"), ("GPTQ 4-bit", "gptq", "bfloat16"),
            ("AWQ 4-bit", "awq", "bfloat16"), ("fp32", "plain", "float32")]  # fmt: skip
    print(f"llama {args.layers} x {args.hidden}, {args.prompts} prompts x {args.tokens} tokens")
    print("| weights | decode tok/s | vs bf16 | weight bytes |")
    print("|---|---:|---:|---:|")
    from engine import LLM, SamplingParams

    engines = {
        label: LLM(str(paths[key]), dtype=dtype, kv_cache_memory=2**28)
        for label, key, dtype in runs
    }
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for llm in engines.values():
        llm.generate(prompts, warm, use_tqdm=False)
    best = dict.fromkeys(engines, 0.0)
    for _ in range(args.rounds):  # alternating, best of each: a busy neighbour hits all alike
        for label, llm in engines.items():
            best[label] = max(best[label], decode_speed(llm, prompts, args.tokens))
    for label, llm in engines.items():
        held = llm.llm_engine.model.weight_bytes()
        ratio = best[label] / best["bf16"]
        print(f"| {label} | {best[label]:.1f} | {ratio:.2f} | {held / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()
