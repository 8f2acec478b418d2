"""pagedq against its peers on one workload: vLLM's CPU build and Hugging Face static batching.

    python bench/peers.py                        # both workloads, every engine found, fp32
    python bench/peers.py --dtype best,default   # what `make bench` prints
    python bench/peers.py --quick                # a one-minute sanity run
    python bench/peers.py --workload mixed --engines pagedq,vllm
    python bench/peers.py --rounds 3             # alternate the engines' order, report medians

``--dtype`` takes one or more of (comma list; every run is made once and shared by the tables):
  float32, bfloat16  every engine in that dtype
  best               every engine in both, each shown at the dtype that was faster for it in
                     this run, with both dtypes' figures
  default            every engine as a user starts it: pagedq ``dtype="auto"`` (measured per
                     host, engine/dtype_probe.py), vLLM its default (bf16 on x86 CPUs), HF fp32

Workloads (greedy, ignore_eos, the default model):
  uniform  64 short chat prompts x 128 new tokens
  mixed    96 chat prompts of 20-400 tokens x 16-512 new tokens (seeded)

Each engine runs in its own process on the same token ids: pagedq and Hugging Face in this
venv, vLLM in ``<peers dir>/venv-vllm`` (``--peers-dir`` or ``$PEERS_DIR``; ``PEERS_DIR=DIR bash
../shared/peers/setup_vllm.sh`` installs it) with the settings its setup script recommends
(tcmalloc, both cores bound, 4 GiB KV cache); pagedq and HF get their OpenMP threads pinned
the same way (``--no-bind`` skips that). Without the venv the vLLM column is skipped with a
note. Every engine is fed all requests at once and stepped to the end; a token's time is the
end of the step that returned it. Prints output tokens/s, time to first token and inter-token
latency (p50/p99), and pagedq's ratio to each peer. The machine is shared and noisy: compare
ratios from one run.

This file imports only the standard library at the top: vLLM's venv runs it as a child too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
WORKLOADS = {
    # name: (num_requests, min_prompt, max_prompt, min_output, max_output)
    "uniform": (64, 20, 48, 128, 128),
    "mixed": (96, 20, 400, 16, 512),
}
QUICK = {"uniform": (16, 20, 48, 32, 32), "mixed": (24, 20, 200, 8, 96)}


# --- metrics -------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def summarize(elapsed: float, token_times: dict[str, list[float]]) -> dict:
    """Tokens/s, TTFT and ITL from each request's token timestamps (seconds since start)."""
    ttft = [times[0] for times in token_times.values() if times]
    itl = [b - a for times in token_times.values() for a, b in zip(times, times[1:])]
    tokens = sum(len(t) for t in token_times.values())
    return {
        "tokens": tokens,
        "elapsed": elapsed,
        "tokens_per_s": tokens / elapsed,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(itl, 50),
        "itl_p99": percentile(itl, 99),
    }


class TokenClock:
    """Stamps each request's new tokens with the time the engine returned them."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: dict[str, list[float]] = {}

    def seen(self, request_id: str, num_tokens: int) -> None:
        """The request now has ``num_tokens`` output tokens."""
        times = self.times.setdefault(request_id, [])
        now = time.perf_counter() - self.start
        times.extend([now] * (num_tokens - len(times)))

    def result(self) -> dict:
        """The summary of the run so far."""
        return summarize(time.perf_counter() - self.start, self.times)


# --- children: one engine each -------------------------------------------------------------
def run_pagedq(work: dict, args) -> dict:
    """Step pagedq's LLMEngine over every request at once."""
    sys.path.insert(0, str(ROOT))
    from engine import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=f"{args.kv_cache_gib}GiB",
    )
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(work["prompts"][:2], warm, use_tqdm=False)
    engine = llm.llm_engine
    clock = TokenClock()
    for i, (prompt, n) in enumerate(zip(work["prompts"], work["out_lens"])):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            clock.seen(out.request_id, len(out.outputs[0].token_ids))
    result = clock.result()
    result["threads"] = engine.num_threads if hasattr(engine, "num_threads") else None
    result["dtype"] = str(engine.dtype).removeprefix("torch.")
    return result


def run_vllm(work: dict, args) -> dict:
    """Step vLLM's LLMEngine (inside its ``LLM``) over every request at once."""
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    llm = LLM(
        model=args.vllm_model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=True,
        seed=0,
    )
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in work["prompts"][:2]], warm, use_tqdm=False)
    engine = llm.llm_engine
    clock = TokenClock()
    for i, (prompt, n) in enumerate(zip(work["prompts"], work["out_lens"])):
        params = SamplingParams(
            temperature=0,
            max_tokens=n,
            ignore_eos=True,
            output_kind=RequestOutputKind.CUMULATIVE,
        )
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            clock.seen(out.request_id, len(out.outputs[0].token_ids))
    result = clock.result()
    result["dtype"] = str(engine.model_config.dtype).removeprefix("torch.")
    return result


def run_hf(work: dict, args) -> dict:
    """Hugging Face ``generate`` in static batches (left padded), every batch to its longest."""
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    sys.path.insert(0, str(ROOT))
    from engine.model_loader import resolve_model

    src = resolve_model(args.model)
    kwargs = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(
        src.folder, dtype=getattr(torch, args.dtype), **kwargs
    ).eval()

    class Stamp(StoppingCriteria):
        def __init__(self, clock, ids, lens):
            self.clock, self.ids, self.lens, self.step = clock, ids, lens, 0

        def __call__(self, input_ids, scores, **kwargs):
            self.step += 1
            for rid, n in zip(self.ids, self.lens):
                if self.step <= n:
                    self.clock.seen(rid, self.step)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def generate(prompts, lens, clock=None, ids=()):
        width = max(len(p) for p in prompts)
        x = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        stop = StoppingCriteriaList([Stamp(clock, ids, lens)] if clock else [])
        with torch.inference_mode():
            model.generate(x, attention_mask=mask, do_sample=False, pad_token_id=0,
                           max_new_tokens=max(lens), min_new_tokens=max(lens),
                           stopping_criteria=stop)  # fmt: skip

    generate(work["prompts"][:2], [4, 4])
    clock = TokenClock()
    prompts, lens, bs = work["prompts"], work["out_lens"], args.hf_batch_size
    for i in range(0, len(prompts), bs):
        ids = [str(j) for j in range(i, min(i + bs, len(prompts)))]
        generate(prompts[i : i + bs], lens[i : i + bs], clock, ids)
    result = clock.result()
    result["dtype"] = str(model.dtype).removeprefix("torch.")
    return result


CHILDREN = {"pagedq": run_pagedq, "vllm": run_vllm, "hf": run_hf}


# --- the parent ----------------------------------------------------------------------------
def make_work(args, name: str) -> dict:
    """Token ids and output lengths of a workload, from the default model's chat template."""
    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT))
    from throughput import make_workload

    from engine.model_loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(args.model))
    spec = (QUICK if args.quick else WORKLOADS)[name]
    if args.num_requests:
        spec = (args.num_requests, *spec[1:])
    prompts, out_lens = make_workload(tok, *spec, seed=args.seed)
    return {"name": name, "spec": spec, "prompts": prompts, "out_lens": out_lens}


def peers_dir(args) -> Path | None:
    """The folder setup_vllm.sh filled (``--peers-dir``, else ``$PEERS_DIR``), if there is one."""
    for candidate in (args.peers_dir, os.environ.get("PEERS_DIR")):
        if candidate and (Path(candidate) / "venv-vllm" / "bin" / "python").exists():
            return Path(candidate)
    return None


# --- dtypes --------------------------------------------------------------------------------
DTYPES = ("float32", "bfloat16")
MODES = (*DTYPES, "best", "default")
# What a user gets without naming a dtype. vLLM's "auto" casts an fp32 checkpoint (the
# dequantized model is one) to its platform's first dtype, bf16 on x86 CPUs
# (vllm/config/model.py, _resolve_auto_dtype); transformers' "auto" keeps the dequantized
# GGUF weights' fp32. pagedq's is measured on this host (default_dtype).
PEER_DEFAULT_DTYPES = {"vllm": "bfloat16", "hf": "float32"}


def default_dtype(engine: str) -> str:
    """The dtype ``engine`` runs in when started without one."""
    if engine != "pagedq":
        return PEER_DEFAULT_DTYPES[engine]
    import torch

    from engine.config import resolve_dtype

    return str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")


def mode_dtypes(mode: str, engine: str) -> list[str]:
    """The dtypes ``engine`` must run in for a table of ``mode``."""
    return {"best": list(DTYPES), "default": [default_dtype(engine)]}.get(mode, [mode])


def planned_runs(engines: list[str], modes: list[str]) -> list[tuple[str, str]]:
    """Every (engine, dtype) the tables need, each once."""
    runs: list[tuple[str, str]] = []
    for mode in modes:
        for engine in engines:
            runs += [(engine, d) for d in mode_dtypes(mode, engine) if (engine, d) not in runs]
    return runs


def child_command(engine: str, dtype: str, args, peers: Path | None, io: tuple[str, str]):
    """(argv, env) of one engine's child process."""
    env = dict(os.environ)
    python = sys.executable
    extra = []
    if engine != "vllm" and not args.no_bind:
        from engine.cpu_threads import bind_env  # main() put the repo on sys.path

        env.update(bind_env())
    if engine == "vllm":
        python = str(peers / "venv-vllm" / "bin" / "python")
        cpus = sorted(os.sched_getaffinity(0))
        env.update(
            VLLM_CPU_OMP_THREADS_BIND=f"{cpus[0]}-{cpus[-1]}",
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
        )
        if os.path.exists(TCMALLOC):
            env["LD_PRELOAD"] = TCMALLOC
        extra = ["--vllm-model", str(peers / "smollm2-hf")]
    argv = [python, __file__, "--child", engine, "--io", *io, *extra, *passthrough(args, dtype)]
    return argv, env


def passthrough(args, dtype: str) -> list[str]:
    """The parent's engine settings, repeated for a child."""
    return [
        "--model", args.model, "--dtype", dtype,
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--kv-cache-gib", str(args.kv_cache_gib), "--hf-batch-size", str(args.hf_batch_size),
        *(["--no-bind"] if args.no_bind else []),
    ]  # fmt: skip


def run_child(engine: str, dtype: str, work: dict, args, peers) -> dict | None:
    """Run one engine on ``work`` in its own process; None (and a note) if it failed."""
    with tempfile.TemporaryDirectory(prefix="pagedq-peers-") as tmp:
        src, dst = os.path.join(tmp, "work.json"), os.path.join(tmp, "result.json")
        Path(src).write_text(json.dumps(work))
        argv, env = child_command(engine, dtype, args, peers, (src, dst))
        print(f"[{work['name']}] running {engine}, {dtype} ...", flush=True)
        log = None if args.verbose else subprocess.DEVNULL
        proc = subprocess.run(argv, env=env, stdout=log, stderr=None if args.verbose else log)
        if proc.returncode != 0 or not os.path.exists(dst):
            print(f"[{work['name']}] {engine} {dtype} failed (exit {proc.returncode}); rerun -v")
            return None
        return json.loads(Path(dst).read_text())


def load_average() -> str:
    """The 1-minute load average (the machine is shared)."""
    try:
        return open("/proc/loadavg").read().split()[0]
    except OSError:
        return "?"


def median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (the lower one of the middle two)."""
    return sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2]


# --- tables --------------------------------------------------------------------------------
Runs = dict[tuple[str, str], list[dict]]


def chosen_dtypes(mode: str, engines: list[str], runs: Runs) -> dict[str, str]:
    """The dtype each engine is shown at in ``mode``'s table (engines without a run left out).

    ``best``: the dtype whose median run made more tokens/s.
    """
    chosen = {}
    for engine in engines:
        done = [d for d in mode_dtypes(mode, engine) if runs.get((engine, d))]
        if done:
            chosen[engine] = max(done, key=lambda d: median_run(runs[engine, d])["tokens_per_s"])
    return chosen


def round_ratios(chosen: dict[str, str], runs: Runs) -> dict[str, list[float]]:
    """pagedq's tokens/s over each peer's, round by round, at the dtypes shown."""
    mine = runs.get(("pagedq", chosen.get("pagedq", "")), [])
    return {
        engine: [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(mine, runs[engine, dtype])]
        for engine, dtype in chosen.items()
        if engine != "pagedq"
    }


MODE_TITLES = {
    "best": "each engine at its faster dtype on this host (both run)",
    "default": "each engine as a user starts it (no dtype given)",
}


def print_table(work: dict, mode: str, engines: list[str], runs: Runs) -> None:
    """The workload's table in one dtype mode, pagedq's ratios, and notes."""
    n, p_lo, p_hi, o_lo, o_hi = work["spec"]
    print(
        f"\n### {work['name']}: {n} requests, prompts {p_lo}-{p_hi} tokens "
        f"(mean {sum(map(len, work['prompts'])) / n:.0f}), outputs {o_lo}-{o_hi} "
        f"(total {sum(work['out_lens'])}), {MODE_TITLES.get(mode, mode)}, greedy, ignore_eos"
    )
    chosen = chosen_dtypes(mode, engines, runs)
    both = "| float32 tok/s | bfloat16 tok/s " if mode == "best" else ""
    print(f"| engine {both}| dtype | output tokens/s | pagedq / engine | "
          "TTFT p50 / p99 s | ITL p50 / p99 ms |")  # fmt: skip
    print("|---" + "|---:" * (2 if mode == "best" else 0) + "|---|---:|---:|---:|---:|")
    base = median_run(runs["pagedq", chosen["pagedq"]]) if "pagedq" in chosen else None
    for engine, dtype in chosen.items():
        r = median_run(runs[engine, dtype])
        ratio = f"{base['tokens_per_s'] / r['tokens_per_s']:.2f}" if base else "-"
        cells = ""
        if mode == "best":
            figures = [runs.get((engine, d)) for d in DTYPES]
            cells = "".join(
                f"| {median_run(f)['tokens_per_s']:.1f} " if f else "| - " for f in figures
            )
        print(
            f"| {LABELS[engine]} {cells}| {r.get('dtype', dtype)} | {r['tokens_per_s']:.1f} | "
            f"{ratio} | {r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | "
            f"{r['itl_p50'] * 1e3:.0f} / {r['itl_p99'] * 1e3:.0f} |"
        )
    for engine, ratios in round_ratios(chosen, runs).items():
        if len(ratios) > 1:
            shown = ", ".join(f"{x:.2f}" for x in ratios)
            print(f"pagedq / {LABELS[engine]} by round: {shown} (median run shown above)")


LABELS = {
    "pagedq": "pagedq",
    "vllm": "vLLM CPU (tcmalloc, cores bound)",
    "hf": "HF static batching",
}


def dtype_notes(engines: list[str], modes: list[str]) -> list[str]:
    """What pagedq's ``auto`` measured on this host, when a table shows it."""
    if "default" not in modes or "pagedq" not in engines:
        return []
    from engine.dtype_probe import probe_cpu_dtype

    probe = probe_cpu_dtype()
    return [
        f"pagedq dtype=auto on this host: {default_dtype('pagedq')} (engine/dtype_probe.py: "
        f"fp32 {probe.float32_s * 1e3:.1f} ms, bf16 {probe.bfloat16_s * 1e3:.1f} ms)"
    ]


def parse_modes(text: str) -> list[str]:
    """``--dtype``'s comma list, checked."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"--dtype {mode!r} is invalid: must be a comma list of {MODES}")
    return modes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["uniform", "mixed", "both"], default="both")
    ap.add_argument("--engines", default="pagedq,vllm,hf", help="comma list of pagedq,vllm,hf")
    ap.add_argument("--quick", action="store_true", help="small sizes for a sanity run")
    ap.add_argument("--num-requests", type=int, default=None, help="override the request count")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument(
        "--dtype", default="float32",
        help=f"comma list of {', '.join(MODES)} (a child takes one dtype)",
    )  # fmt: skip
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=int, default=4)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--peers-dir", default=None,
        help="where setup_vllm.sh installed vLLM (default: $PEERS_DIR)",
    )  # fmt: skip
    ap.add_argument("--no-bind", action="store_true", help="leave pagedq/HF threads unpinned")
    ap.add_argument(
        "--rounds", type=int, default=1,
        help="run every engine this many times, alternating their order; report the median run",
    )  # fmt: skip
    ap.add_argument("-v", "--verbose", action="store_true", help="show the children's output")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--io", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--vllm-model", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        work = json.loads(Path(args.io[0]).read_text())
        Path(args.io[1]).write_text(json.dumps(CHILDREN[args.child](work, args)))
        return

    sys.path.insert(0, str(ROOT))
    modes = parse_modes(args.dtype)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    peers = peers_dir(args)
    notes = dtype_notes(engines, modes)
    if "vllm" in engines and peers is None:
        engines.remove("vllm")
        notes.append(
            "vLLM: skipped, no venv-vllm in --peers-dir or $PEERS_DIR "
            "(install: PEERS_DIR=DIR bash ../shared/peers/setup_vllm.sh)"
        )
    plan = planned_runs(engines, modes)
    names = ["uniform", "mixed"] if args.workload == "both" else [args.workload]
    load_before = load_average()
    tables = []
    for name in names:
        work = make_work(args, name)
        runs: Runs = {key: [] for key in plan}
        for r in range(args.rounds):
            # A machine whose speed drifts favours whoever runs first: alternate the order.
            for engine, dtype in plan if r % 2 == 0 else plan[::-1]:
                result = run_child(engine, dtype, work, args, peers)
                if result is not None:
                    runs[engine, dtype].append(result)
        tables.append((work, runs))
        if len(names) > 1:  # partial results survive an interrupted run
            for mode in modes:
                print_table(work, mode, engines, runs)
    print(f"\nload average {load_before} before, {load_average()} after ({os.cpu_count()} CPUs)")
    for mode in modes:
        for work, runs in tables:
            print_table(work, mode, engines, runs)
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
