"""Cache layouts per layer group, measured: hybrid linear attention and sliding windows.

    python bench/hybrid.py                 # both parts, pagedq only
    python bench/hybrid.py --vllm          # also try vLLM's CPU build on the qwen3_5 checkpoint

1. Decode tokens/s of a small random ``qwen3_5_text`` checkpoint (hidden 256, 8 layers: 6 Gated
   DeltaNet + 2 gated full attention) at contexts 512 and 4,096, 4 sequences, 32 decode steps
   timed one by one after the prefill (after a short warm-up run; tokens/s of the median step),
   fp32, one thread, and the time spent inside the linear layers per step. The same config with
   every layer full attention is the contrast: its step cost grows with the context, the
   linear layers' does not.
2. The largest batch of 1,024-token sequences that fits a fixed KV budget (8 MiB) for a small
   random ``gemma3_text`` (5 of 6 layers with a 128-token window), read from the engine's own
   block accounting: "before" is the layout where every layer is full-attention grouped (the
   bench swaps ``make_layout``'s input for full-attention specs: windows still apply in the
   kernels but no block is given back), "after" the per-group layout.

Checkpoints are made once under ``--model-dir``. The machine is shared and noisy: compare the
ratios of one run, not absolute figures across runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

HYBRID = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
    linear_key_head_dim=64, linear_value_head_dim=64, max_position_embeddings=8192,
)  # fmt: skip
WINDOWED = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64, sliding_window=128,
    max_position_embeddings=4096,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
)  # fmt: skip
DEFAULT_DIR = Path.home() / ".cache" / "pagedq" / "bench" / "hybrid"


def checkpoint(folder: Path, model_type: str, config: dict) -> Path:
    """A random checkpoint (made once; remade when its config differs)."""
    from tiny_models import make_tiny_model

    stamp = folder / "bench_config.json"
    want = json.dumps([model_type, config], sort_keys=True)
    if not stamp.exists() or stamp.read_text() != want:
        make_tiny_model(folder, model_type, **config)
        stamp.write_text(want)
    return folder


def decode_tokens_per_s(
    folder: Path, context: int, batch: int = 4, steps: int = 32
) -> tuple[float, float]:
    """Decode tokens/s of ``batch`` sequences of ``context`` prompt tokens (prefill untimed),
    and the median step's milliseconds inside the Gated DeltaNet layers (0 without any)."""
    import random

    from engine import LLM, SamplingParams
    from engine.models.qwen3_5 import GatedDeltaNet

    llm = LLM(str(folder), dtype="float32", kv_cache_memory="256MiB", num_threads=1,
              enable_prefix_caching=False)  # fmt: skip
    engine = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(5, 40000) for _ in range(context)], params)
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    linear, starts = [0.0], {}

    def start(module, args):
        starts[module] = time.perf_counter()

    def stop(module, args, out):
        linear[0] += time.perf_counter() - starts[module]

    for module in engine.model.modules():
        if isinstance(module, GatedDeltaNet):
            module.register_forward_pre_hook(start)
            module.register_forward_hook(stop)
    times, linear_times = [], []
    while engine.has_unfinished_requests():
        linear[0] = 0.0
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        linear_times.append(linear[0])
    # The median step: the shared host's stalls hit a few steps, not the typical one.
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return batch / median(times), 1000 * median(linear_times)


def largest_batch(folder: Path, length: int, budget: str, full_layout: bool) -> tuple[int, int]:
    """``(sequences of length tokens that fit, blocks in the pool)`` under ``budget``."""
    import engine.llm_engine as llm_engine
    from engine import LLM
    from engine.kv_cache_spec import FullAttentionSpec, make_layout

    saved = llm_engine.make_layout
    if full_layout:
        llm_engine.make_layout = lambda specs: make_layout(
            [FullAttentionSpec(*s.page_shape) for s in specs]
        )
    try:
        llm = LLM(str(folder), dtype="float32", kv_cache_memory=budget, num_threads=1)
    finally:
        llm_engine.make_layout = saved
    kv = llm.llm_engine.kv_cache_manager
    return kv.num_free_blocks // kv.num_blocks_for(length), kv.block_pool.num_blocks


VLLM_CHILD = r"""
import sys, time, random
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=8192, enforce_eager=True)
for context in (512, 4096):
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(5, 40000) for _ in range(context)]}
               for _ in range(4)]
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=33, temperature=0, ignore_eos=True))
    print("VLLM", context, 4 * 33 / (time.perf_counter() - t0), flush=True)
"""


def run_vllm(folder: Path, peers: Path) -> str:
    """vLLM CPU on the same qwen3_5 checkpoint (prefill included in its timing), or why not."""
    python = peers / "venv-vllm" / "bin" / "python"
    if not python.exists():
        return f"vLLM: no venv at {python}"
    try:
        out = subprocess.run(
            [str(python), "-c", VLLM_CHILD, str(folder)], capture_output=True, text=True,
            timeout=900,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return "vLLM: did not finish in 900 s"
    lines = [line for line in out.stdout.splitlines() if line.startswith("VLLM")]
    if out.returncode or not lines:
        tail = [ln for ln in (out.stderr or out.stdout).splitlines() if "Error" in ln][-3:]
        return "vLLM CPU does not run this checkpoint: " + " | ".join(tail)
    return "\n".join(
        f"vLLM context {c}: {float(v):.1f} tok/s (incl. prefill)"
        for _, c, v in (line.split() for line in lines)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--vllm", action="store_true", help="also run vLLM's CPU build")
    parser.add_argument("--peers-dir", type=Path, default=Path("/work/peers"))
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    hybrid = checkpoint(args.model_dir / "qwen3_5", "qwen3_5_text", HYBRID)
    full = checkpoint(
        args.model_dir / "qwen3_5-full",
        "qwen3_5_text",
        {**HYBRID, "layer_types": ["full_attention"] * HYBRID["num_hidden_layers"]},
    )
    for name, folder in (("hybrid (6 linear + 2 full)", hybrid), ("all full attention", full)):
        decode_tokens_per_s(folder, 64, steps=4)  # warm-up: kernel builds, GEMM probes
        (short, lin_short), (long, lin_long) = (
            decode_tokens_per_s(folder, 512), decode_tokens_per_s(folder, 4096)
        )  # fmt: skip
        line = (f"{name}: decode {short:.1f} tok/s at 512, {long:.1f} at 4096: "
                f"ratio 4096/512 = {long / short:.2f}")  # fmt: skip
        if lin_short:
            line += (f"; linear layers {lin_short:.2f} ms/step at 512, {lin_long:.2f} at 4096 "
                     f"(ratio {lin_long / lin_short:.2f})")  # fmt: skip
        print(line)

    windowed = checkpoint(args.model_dir / "gemma3", "gemma3_text", WINDOWED)
    before, blocks_before = largest_batch(windowed, 1024, "8MiB", full_layout=True)
    after, blocks_after = largest_batch(windowed, 1024, "8MiB", full_layout=False)
    print(f"gemma3 windows, 8 MiB KV, 1024-token sequences: {before} fit before "
          f"({blocks_before} blocks), {after} after ({blocks_after} blocks): "
          f"{after / max(before, 1):.1f}x")  # fmt: skip
    if args.vllm:
        print(run_vllm(hybrid, args.peers_dir))


if __name__ == "__main__":
    main()
