"""Structured outputs, pagedq against vLLM's CPU build: the same chats and JSON schemas, one run.

    python bench/structured_peers.py --peers-dir DIR          # or PEERS_DIR in the environment
    python bench/structured_peers.py --dtype bfloat16 --num-requests 96

Each engine runs in its own process (vLLM from ``<peers dir>/venv-vllm``, set up by
``../shared/peers/setup_vllm.sh``) on the same chat requests: bench/structured.py's five schema
shapes plus, on every 16th request, a schema with ``uniqueItems`` (which neither engine's grammar
backend enforces). Half the requests are greedy, half sampled. Per engine:

1. each distinct schema is tried alone (one token): a schema the engine refuses drops its
   requests from both runs of that engine, and is counted as refused;
2. the accepted requests, constrained, all at once: output tokens/s;
3. the same requests unconstrained, ``ignore_eos``, each request's ``max_tokens`` set to the
   length of its own constrained output, all at once: the same tokens without the grammar.

The parent validates every constrained output that stopped by itself against its schema
(jsonschema) and prints, per engine, tokens/s both ways, their ratio, outputs valid / invalid /
cut at ``max_tokens``, refused requests; then pagedq / vLLM constrained tokens/s. vLLM runs with
the settings its setup script recommends (tcmalloc, both cores bound). Without the venv only
pagedq is run. The machine is shared and noisy: compare ratios from one run.

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
sys.path.insert(0, str(ROOT / "bench"))

from peers import TCMALLOC, peers_dir  # noqa: E402
from structured import ASKS, SCHEMAS, TOPICS  # noqa: E402

UNSUPPORTED = {
    "type": "object",
    "properties": {
        "colors": {
            "type": "array",
            "items": {"enum": ["red", "green", "blue", "black"]},
            "minItems": 2,
            "maxItems": 3,
            "uniqueItems": True,
        }
    },
    "required": ["colors"],
    "additionalProperties": False,
}
UNSUPPORTED_ASK = "Pick two or three different colors for a {t} poster, as JSON."


def make_requests(num: int, max_tokens: int) -> list[dict]:
    """The workload: one dict per request (messages, schema index, sampling settings)."""
    out = []
    for i in range(num):
        topic = TOPICS[(i // len(SCHEMAS)) % len(TOPICS)]
        kind = len(SCHEMAS) if i % 16 == 15 else i % len(SCHEMAS)
        ask = UNSUPPORTED_ASK if kind == len(SCHEMAS) else ASKS[kind]
        sampling = {"temperature": 0.0} if i % 2 else {"temperature": 0.7, "seed": i}
        out.append(
            {
                "messages": [{"role": "user", "content": ask.format(t=topic)}],
                "schema": kind,
                "max_tokens": max_tokens,
                **sampling,
            }
        )
    return out


def schemas() -> list[dict]:
    """Every schema by index: bench/structured.py's, then the unsupported one."""
    return [*SCHEMAS, UNSUPPORTED]


# --- the children ----------------------------------------------------------------------------
def run_engine(work: dict, make_params, chat, output_of) -> dict:
    """The three phases of the module docstring, with engine-specific hooks."""
    requests, table = work["requests"], schemas()
    refused: dict[int, str] = {}
    for kind in sorted({r["schema"] for r in requests}):
        probe = {**next(r for r in requests if r["schema"] == kind), "max_tokens": 1}
        try:
            chat([probe["messages"]], [make_params(probe, table[kind], None)])
        except Exception as e:  # each engine raises its own type for a schema it refuses
            refused[kind] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    kept = [r for r in requests if r["schema"] not in refused]
    t0 = time.perf_counter()
    outs = chat(
        [r["messages"] for r in kept], [make_params(r, table[r["schema"]], None) for r in kept]
    )
    t_c = time.perf_counter() - t0
    texts, reasons, lengths = zip(*(output_of(o) for o in outs)) if outs else ((), (), ())
    plain = [make_params(r, None, n) for r, n in zip(kept, lengths)]
    t0 = time.perf_counter()
    outs_u = chat([r["messages"] for r in kept], plain)
    t_u = time.perf_counter() - t0
    tokens_u = sum(output_of(o)[2] for o in outs_u)
    return {
        "kept": [requests.index(r) for r in kept],
        "refused": {str(k): v for k, v in refused.items()},
        "texts": list(texts),
        "finish_reasons": list(reasons),
        "tokens": sum(lengths),
        "tokens_unconstrained": tokens_u,
        "seconds": t_c,
        "seconds_unconstrained": t_u,
    }


def run_pagedq(work: dict, args) -> dict:
    """pagedq's offline `LLM`, constrained by StructuredOutputsParams(json=...)."""
    sys.path.insert(0, str(ROOT))
    from engine import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(args.model, dtype=args.dtype)

    def make_params(r, schema, n):
        sampling = {k: r[k] for k in ("temperature", "seed") if k in r}
        if schema is None:
            return SamplingParams(max_tokens=max(n, 1), ignore_eos=True, **sampling)
        so = StructuredOutputsParams(json=schema)
        return SamplingParams(max_tokens=r["max_tokens"], structured_outputs=so, **sampling)

    def chat(messages, params):
        return llm.chat(messages, params, use_tqdm=False)

    def output_of(o):
        c = o.outputs[0]
        return c.text, c.finish_reason, len(c.token_ids)

    chat([work["requests"][0]["messages"]], [make_params(work["requests"][0], None, 4)])
    result = run_engine(work, make_params, chat, output_of)
    result["dtype"] = str(llm.llm_engine.dtype).removeprefix("torch.")
    return result


def run_vllm(work: dict, args) -> dict:
    """vLLM's offline `LLM`, constrained by its StructuredOutputsParams(json=...)."""
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(model=args.vllm_model, dtype=args.dtype, enable_prefix_caching=True, seed=0)

    def make_params(r, schema, n):
        sampling = {k: r[k] for k in ("temperature", "seed") if k in r}
        if schema is None:
            return SamplingParams(max_tokens=max(n, 1), ignore_eos=True, **sampling)
        so = StructuredOutputsParams(json=schema)
        return SamplingParams(max_tokens=r["max_tokens"], structured_outputs=so, **sampling)

    def chat(messages, params):
        return llm.chat(messages, params, use_tqdm=False)

    def output_of(o):
        c = o.outputs[0]
        return c.text, c.finish_reason, len(c.token_ids)

    chat([work["requests"][0]["messages"]], [make_params(work["requests"][0], None, 4)])
    result = run_engine(work, make_params, chat, output_of)
    result["dtype"] = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    return result


CHILDREN = {"pagedq": run_pagedq, "vllm": run_vllm}


# --- the parent --------------------------------------------------------------------------------
def child_command(engine: str, args, peers: Path | None, io: tuple[str, str]):
    """(argv, env) of one engine's child process."""
    env = dict(os.environ)
    python, extra = sys.executable, []
    if engine == "pagedq":
        sys.path.insert(0, str(ROOT))
        from engine.cpu_threads import bind_env

        env.update(bind_env())
    else:
        python = str(peers / "venv-vllm" / "bin" / "python")
        cpus = sorted(os.sched_getaffinity(0))
        env.update(
            VLLM_CPU_OMP_THREADS_BIND=f"{cpus[0]}-{cpus[-1]}",
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_CPU_KVCACHE_SPACE="4",
        )
        if os.path.exists(TCMALLOC):
            env["LD_PRELOAD"] = TCMALLOC
        extra = ["--vllm-model", str(peers / "smollm2-hf")]
    argv = [python, __file__, "--child", engine, "--io", *io, *extra]
    return argv, env


def run_child(engine: str, work: dict, args, peers) -> dict | None:
    """One engine on `work` in its own process; None (and a note) when it failed."""
    with tempfile.TemporaryDirectory(prefix="pagedq-structured-") as tmp:
        src, dst = os.path.join(tmp, "work.json"), os.path.join(tmp, "result.json")
        Path(src).write_text(json.dumps(work))
        argv, env = child_command(engine, args, peers, (src, dst))
        argv += ["--model", args.model, "--dtype", args.dtype]
        print(f"running {engine}, {args.dtype} ...", flush=True)
        log = None if args.verbose else subprocess.DEVNULL
        proc = subprocess.run(argv, env=env, stdout=log, stderr=None if args.verbose else log)
        if proc.returncode != 0 or not os.path.exists(dst):
            print(f"{engine} failed (exit {proc.returncode}); rerun with -v")
            return None
        return json.loads(Path(dst).read_text())


def grade(work: dict, result: dict) -> dict:
    """Outputs valid / invalid / cut at max_tokens, by jsonschema."""
    import jsonschema

    table, counts = schemas(), {"valid": 0, "invalid": 0, "length": 0}
    for i, text, reason in zip(result["kept"], result["texts"], result["finish_reasons"]):
        if reason == "length":
            counts["length"] += 1
            continue
        try:
            jsonschema.validate(json.loads(text), table[work["requests"][i]["schema"]])
            counts["valid"] += 1
        except (ValueError, jsonschema.ValidationError):
            counts["invalid"] += 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--engines", default="pagedq,vllm", help="comma list of pagedq,vllm")
    ap.add_argument("--peers-dir", help="the folder setup_vllm.sh filled (or $PEERS_DIR)")
    ap.add_argument("-v", "--verbose", action="store_true", help="show the children's output")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--io", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--vllm-model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        work = json.loads(Path(args.io[0]).read_text())
        Path(args.io[1]).write_text(json.dumps(CHILDREN[args.child](work, args)))
        return

    peers = peers_dir(args)
    engines = args.engines.split(",")
    if "vllm" in engines and peers is None:
        print("vLLM skipped: no <peers dir>/venv-vllm (--peers-dir or PEERS_DIR)")
        engines.remove("vllm")
    work = {"requests": make_requests(args.num_requests, args.max_tokens)}
    results = {e: run_child(e, work, args, peers) for e in engines}
    print(
        f"\n{args.num_requests} chat requests, JSON schema each, max_tokens {args.max_tokens}, "
        f"{args.model} {args.dtype}, load average {open('/proc/loadavg').read().split()[0]}"
    )
    print(
        "| engine | refused | constrained tok/s | unconstrained tok/s | ratio | valid | "
        "invalid | cut at max_tokens |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rates = {}
    for engine, r in results.items():
        if r is None:
            continue
        c = r["tokens"] / r["seconds"]
        u = r["tokens_unconstrained"] / r["seconds_unconstrained"]
        rates[engine] = c
        g = grade(work, r)
        refused = sum(1 for q in work["requests"] if str(q["schema"]) in r["refused"])
        print(
            f"| {engine} | {refused} | {c:.1f} | {u:.1f} | {c / u:.2f} | {g['valid']} | "
            f"{g['invalid']} | {g['length']} |"
        )
        for kind, why in r["refused"].items():
            print(f"    {engine} refused schema {kind}: {why}")
    if len(rates) == 2:
        print(f"\npagedq / vLLM, constrained tokens/s: {rates['pagedq'] / rates['vllm']:.2f}")


if __name__ == "__main__":
    main()
