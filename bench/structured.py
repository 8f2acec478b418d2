"""Structured outputs: constrained against unconstrained tokens/s on the same prompts.

    python bench/structured.py                     # 32 chat prompts, 5 JSON schemas, 3 rounds
    python bench/structured.py --num-requests 64 --rounds 5
    python bench/structured.py --peers-dir DIR     # then the same against vLLM's CPU build

With vLLM's CPU build in ``--peers-dir`` or ``$PEERS_DIR`` (``../shared/peers/setup_vllm.sh``),
it then runs bench/structured_peers.py: both engines on the same chats and schemas in one run,
each constrained and unconstrained, every output validated with jsonschema.

Each round runs the constrained batch (a JSON schema per request, half greedy, half sampled),
the same batch with fast-forward off (every token a decode step: the cost of the masks alone),
then the same prompts unconstrained with ``ignore_eos`` and each request's ``max_tokens`` set to
the length its constrained output had, so every run produces the same number of tokens per
request. Rounds alternate the two; the ratio is taken per round and its median printed (the
machines are shared and noisy). Forced tokens are counted as generated: they are output the
user gets, and skipping their decode steps is the point of forcing them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "topic": {"type": "string", "maxLength": 20},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 4},
        },
        "required": ["topic", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["sentiment", "confidence"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "year": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "director": {"type": "string", "maxLength": 30},
        },
        "required": ["title", "year"],
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"item": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
            "required": ["item", "qty"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 4,
    },
]
TOPICS = "cooking gardening music history oceans planets trains painting chess coffee".split()
ASKS = [
    "Invent a person interested in {t}: name, age and address, as JSON.",
    "Give a topic and tags about {t}, as JSON.",
    "What is the sentiment of 'I really enjoy {t}'? Answer in JSON.",
    "Name a movie about {t} with its year and director, as JSON.",
    "Write a shopping list for {t} as a JSON array of items with quantities.",
]


def workload(num_requests: int, max_tokens: int):
    from engine import SamplingParams, StructuredOutputsParams

    chats, params = [], []
    for i in range(num_requests):
        kind = i % len(SCHEMAS)
        text = ASKS[kind].format(t=TOPICS[(i // len(SCHEMAS)) % len(TOPICS)])
        chats.append([{"role": "user", "content": text}])
        sampling = {"temperature": 0} if i % 2 else {"temperature": 0.7, "seed": i}
        so = StructuredOutputsParams(json=SCHEMAS[kind])
        params.append(SamplingParams(max_tokens=max_tokens, structured_outputs=so, **sampling))
    return chats, params


def timed(llm, chats, params):
    t0 = time.perf_counter()
    outs = llm.chat(chats, params, use_tqdm=False)
    return time.perf_counter() - t0, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--peers-dir", help="vLLM's venv folder (setup_vllm.sh; or $PEERS_DIR)")
    args = ap.parse_args()

    from dataclasses import replace

    from engine import LLM

    llm = LLM(args.model, dtype=args.dtype)
    chats, params = workload(args.num_requests, args.max_tokens)
    timed(llm, chats[:2], params[:2])  # warm-up: the tokenizer for llguidance, first kernels
    ratios, mask_ratios, rows = [], [], []
    for r in range(args.rounds):
        before = llm.stats
        t_c, outs = timed(llm, chats, params)
        after = llm.stats
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        plain = [
            replace(p, structured_outputs=None, max_tokens=n, ignore_eos=True)
            for p, n in zip(params, lengths)
        ]
        llm.llm_engine.structured.enable_fast_forward = False
        greedy = [i for i, p in enumerate(params) if p.temperature == 0]
        t_m, outs_m = timed(llm, [chats[i] for i in greedy], [params[i] for i in greedy])
        llm.llm_engine.structured.enable_fast_forward = True
        t_u, outs_u = timed(llm, chats, plain)
        t_ug, _ = timed(llm, [chats[i] for i in greedy], [plain[i] for i in greedy])
        tokens = sum(lengths)
        assert tokens == sum(len(o.outputs[0].token_ids) for o in outs_u)
        # Greedy outputs do not depend on fast-forward: the same tokens, one step each.
        assert [o.outputs[0].token_ids for o in outs_m] == [
            outs[i].outputs[0].token_ids for i in greedy
        ]
        mask_ratio = t_ug / t_m
        forced = after.num_forced_tokens - before.num_forced_tokens
        steps = after.num_steps - before.num_steps
        stopped = sum(o.outputs[0].finish_reason == "stop" for o in outs)
        ratio = (tokens / t_c) / (tokens / t_u)
        ratios.append(ratio)
        rows.append(
            (
                r,
                tokens,
                tokens / t_c,
                tokens / t_u,
                ratio,
                mask_ratio,
                forced / tokens,
                steps,
                stopped,
            )
        )
        mask_ratios.append(mask_ratio)
    print(f"{args.num_requests} requests, {args.model} {args.dtype}, max_tokens {args.max_tokens}")
    print(
        "round  tokens  constrained tok/s  unconstrained tok/s  ratio  "
        "ratio greedy no-ff  forced  steps  stopped"
    )
    for r, tokens, c, u, ratio, mask_ratio, share, steps, stopped in rows:
        print(
            f"{r:5d}  {tokens:6d}  {c:17.1f}  {u:19.1f}  {ratio:5.2f}  {mask_ratio:18.2f}  "
            f"{share:6.1%}  {steps:5d}  {stopped:4d}/{args.num_requests}"
        )
    stats = llm.stats
    print(f"median ratio constrained / unconstrained: {statistics.median(ratios):.2f}")
    print(
        "median ratio, greedy half without fast-forward (masks only): "
        f"{statistics.median(mask_ratios):.2f}"
    )
    print(
        f"grammar compiles: {stats.num_grammar_compiles} in {stats.grammar_compile_seconds:.3f} s, "
        f"cache hits {stats.grammar_cache_hits}"
    )
    peers = args.peers_dir or os.environ.get("PEERS_DIR")
    if peers and (Path(peers) / "venv-vllm" / "bin" / "python").exists():
        del llm  # free the cores' memory for the two children
        print("\nagainst vLLM's CPU build (bench/structured_peers.py):", flush=True)
        here = Path(__file__).resolve().parent
        subprocess.run(
            [sys.executable, str(here / "structured_peers.py"), "--peers-dir", peers,
             "--model", args.model, "--dtype", args.dtype,
             "--num-requests", str(args.num_requests), "--max-tokens", str(args.max_tokens)],
            check=False,
        )  # fmt: skip
    else:
        print("\nvLLM skipped: no <peers dir>/venv-vllm (--peers-dir or PEERS_DIR)")


if __name__ == "__main__":
    main()
