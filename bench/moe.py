"""pagedq against vLLM's CPU build on a mixture-of-experts model where the experts dominate.

    python bench/moe.py                          # fp32 and bf16, both engines, one run
    python bench/moe.py --dtype bfloat16 --rounds 3
    python bench/moe.py --peers-dir ~/peers -v

The model is a random Qwen3-MoE checkpoint made here once from transformers' ``Qwen3MoeConfig``
(hidden 1024, 8 layers, 64 experts, top-8, expert intermediate 256: 0.53 B parameters, 0.40 B
of them in the experts; saved in bf16 with per-expert tensors, the default model's tokenizer)
under ``--model-dir``. The workload: 32 prompts of 64 random token ids, 64 new tokens each,
greedy, ignore_eos; every engine is fed all requests at once and stepped to the end (as
``bench/peers.py`` does, whose children this file reuses). vLLM runs from
``<peers dir>/venv-vllm`` (``--peers-dir`` or ``$PEERS_DIR``; ``PEERS_DIR=DIR bash
../shared/peers/setup_vllm.sh`` installs it) with tcmalloc and both cores bound; pagedq's
threads are pinned the same way. Prints output tokens/s, TTFT and ITL, and pagedq's ratio to
vLLM per dtype. The machine is shared and noisy: compare ratios from one run.

This file imports only the standard library at the top: vLLM's venv runs it as a child too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import peers  # noqa: E402  (standard library only at its top, like this file)

CONFIG = dict(
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=256,
    intermediate_size=2048,  # dense layers: none here (every layer is sparse)
    norm_topk_prob=True,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
DEFAULT_DIR = Path.home() / ".cache" / "pagedq" / "bench" / "qwen3-moe-0.5b"


def make_checkpoint(folder: Path, moe_intermediate_size: int) -> Path:
    """The random Qwen3-MoE checkpoint in ``folder`` (made once; remade if its config differs)."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT))
    from engine.model_loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model("smollm2"))
    wanted = {**CONFIG, "moe_intermediate_size": moe_intermediate_size, "vocab_size": len(tok)}
    if (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
        saved = transformers.AutoConfig.from_pretrained(folder)  # names as the class maps them
        if all(getattr(saved, k, None) == v for k, v in wanted.items()):
            return folder
    print(f"making the random Qwen3-MoE checkpoint in {folder} ...", flush=True)
    config = transformers.Qwen3MoeConfig(**wanted)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    params = sum(p.numel() for p in model.parameters())
    print(f"  {params / 1e9:.2f} B parameters", flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def make_work(args, vocab_size: int) -> dict:
    """The same random prompts for every engine."""
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(100, vocab_size - 100) for _ in range(args.prompt_len)]
        for _ in range(args.num_requests)
    ]
    out_lens = [args.output_len] * args.num_requests
    spec = (args.num_requests, args.prompt_len, args.prompt_len, args.output_len, args.output_len)
    return {"name": "moe", "spec": spec, "prompts": prompts, "out_lens": out_lens}


def child_command(engine: str, dtype: str, args, peers_root: Path | None, io: tuple[str, str]):
    """(argv, env) of one engine's child process (bench/peers.py's settings)."""
    env = dict(os.environ)
    python = sys.executable
    if engine == "vllm":
        python = str(peers_root / "venv-vllm" / "bin" / "python")
        cpus = sorted(os.sched_getaffinity(0))
        env.update(
            VLLM_CPU_OMP_THREADS_BIND=f"{cpus[0]}-{cpus[-1]}",
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
        )
        if os.path.exists(peers.TCMALLOC):
            env["LD_PRELOAD"] = peers.TCMALLOC
    elif not args.no_bind:
        from engine.cpu_threads import bind_env

        env.update(bind_env())
    argv = [
        python, __file__, "--child", engine, "--io", *io, "--model-dir", str(args.model_dir),
        "--dtype", dtype, "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--kv-cache-gib", str(args.kv_cache_gib),
    ]  # fmt: skip
    return argv, env


def run_child(engine: str, dtype: str, work: dict, args, peers_root) -> dict | None:
    """One engine on ``work`` in its own process; None (and a note) if it failed."""
    with tempfile.TemporaryDirectory(prefix="pagedq-moe-") as tmp:
        src, dst = os.path.join(tmp, "work.json"), os.path.join(tmp, "result.json")
        Path(src).write_text(json.dumps(work))
        argv, env = child_command(engine, dtype, args, peers_root, (src, dst))
        print(f"running {engine}, {dtype} ...", flush=True)
        log = None if args.verbose else subprocess.DEVNULL
        proc = subprocess.run(argv, env=env, stdout=log, stderr=None if args.verbose else log)
        if proc.returncode != 0 or not os.path.exists(dst):
            print(f"{engine} {dtype} failed (exit {proc.returncode}); rerun with -v")
            return None
        return json.loads(Path(dst).read_text())


def print_table(work: dict, dtypes: list[str], runs: dict) -> None:
    """One row per (engine, dtype) and pagedq's ratio to vLLM in the same dtype."""
    n, p, _, o, _ = work["spec"]
    print(f"\n### Qwen3-MoE 0.5 B (random): {n} requests x {p} prompt tokens x {o} new tokens")
    print(
        "| engine | dtype | output tokens/s | pagedq / vLLM | TTFT p50 / p99 s | ITL p50 / p99 ms |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for dtype in dtypes:
        mine = runs.get(("pagedq", dtype))
        for engine in ("pagedq", "vllm"):
            got = runs.get((engine, dtype))
            if not got:
                continue
            r = peers.median_run(got)
            ratio = "-"
            if engine == "vllm" and mine:
                ratio = f"{peers.median_run(mine)['tokens_per_s'] / r['tokens_per_s']:.2f}"
            print(
                f"| {peers.LABELS[engine]} | {dtype} | {r['tokens_per_s']:.1f} | {ratio} | "
                f"{r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | "
                f"{r['itl_p50'] * 1e3:.0f} / {r['itl_p99'] * 1e3:.0f} |"
            )
        if mine and runs.get(("vllm", dtype)) and len(mine) > 1:
            by_round = [
                a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(mine, runs["vllm", dtype])
            ]
            print(f"{dtype}: pagedq / vLLM by round: {', '.join(f'{x:.2f}' for x in by_round)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="pagedq,vllm", help="comma list of pagedq,vllm")
    ap.add_argument("--dtype", default="float32,bfloat16", help="comma list of float32,bfloat16")
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--moe-intermediate-size", type=int, default=256)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, help="alternate the engines' order")
    ap.add_argument("--peers-dir", default=None, help="default: $PEERS_DIR")
    ap.add_argument("--no-bind", action="store_true", help="leave pagedq's threads unpinned")
    ap.add_argument("-v", "--verbose", action="store_true", help="show the children's output")
    ap.add_argument("--child", choices=sorted(peers.CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--io", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:  # peers.py's children read the model from these names
        args.model = args.vllm_model = str(args.model_dir)
        work = json.loads(Path(args.io[0]).read_text())
        Path(args.io[1]).write_text(json.dumps(peers.CHILDREN[args.child](work, args)))
        return

    sys.path.insert(0, str(ROOT))
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    for dtype in dtypes:
        if dtype not in peers.DTYPES:
            raise SystemExit(
                f"--dtype {dtype!r} is invalid: must be a comma list of {peers.DTYPES}"
            )
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    peers_root = peers.peers_dir(args)
    if "vllm" in engines and peers_root is None:
        engines.remove("vllm")
        print("vLLM: skipped, no venv-vllm in --peers-dir or $PEERS_DIR")
    make_checkpoint(args.model_dir, args.moe_intermediate_size)
    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    work = make_work(args, vocab)
    plan = [(engine, dtype) for dtype in dtypes for engine in engines]
    runs: dict = {key: [] for key in plan}
    load_before = peers.load_average()
    for r in range(args.rounds):
        for engine, dtype in plan if r % 2 == 0 else plan[::-1]:
            result = run_child(engine, dtype, work, args, peers_root)
            if result is not None:
                runs[engine, dtype].append(result)
                print(f"  {result['tokens_per_s']:.1f} output tokens/s", flush=True)
    print(f"\nload average {load_before} before, {peers.load_average()} after")
    print_table(work, dtypes, runs)


if __name__ == "__main__":
    main()
