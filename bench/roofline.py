"""Decode step time against its matrix-product floor, per batch size.

    python bench/roofline.py                          # batches 1 8 32 64 128 256, context 512
    python bench/roofline.py --batches 64 --profile   # where the time of one step goes

The floor of a decode step is the model's own ``F.linear`` calls alone (every layer's QKV, O,
gate/up and down projections plus the LM head over the batch), in the model's dtype: no
attention, norms, rotary, sampling or Python. A step is one full ``LLMEngine.step()`` of
``batch`` requests that each hold ``context`` tokens in the paged cache (random K/V, written
once), so scheduling, input building, sampling and detokenization count too. Ratios are
measured in one run; the machine's load changes absolute times, much less the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def interleaved_medians(fns: dict, repeats: int) -> dict:
    """Median wall time in seconds of each of ``fns``, after one warm-up call of each.

    The calls take turns (one of each per round), so that a change in the machine's load
    during the measurement weighs on every function alike and their ratios hold.
    """
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def linear_floor(model, batch: int) -> tuple:
    """One step's matrix products alone, as two calls: ``F.linear`` on plain weights (the
    floor), and the model's own projection modules (prepacked for oneDNN where the engine packs
    them).
    """
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    dtype = model.embed_tokens.weight.dtype
    x = torch.randn(batch, model.embed_tokens.weight.shape[1], dtype=dtype)
    a = torch.randn(batch, attn.q_size, dtype=dtype)
    h = torch.randn(batch, mlp.intermediate_size, dtype=dtype)
    modules, plain = [], []
    for layer in model.layers:
        sa, m = layer.self_attn, layer.mlp
        for module, inp in (
            (sa.qkv_proj, x),
            (sa.o_proj, a),
            (m.gate_up_proj, x),
            (m.down_proj, h),
        ):
            modules.append((module, inp))
            plain.append((module.weight.contiguous(), module.bias, inp))
    if model.tie_word_embeddings:
        plain.append((model.embed_tokens.weight, None, x))
    else:
        plain.append((model.lm_head.weight.contiguous(), None, x))

    def dense():
        with torch.inference_mode():
            for weight, bias, inp in plain:
                F.linear(inp, weight, bias)

    def own():
        with torch.inference_mode():
            for module, inp in modules:
                module(inp)
            model.compute_logits(x)

    return dense, own


class AttentionTimer:
    """Wraps every layer's attention call and adds up its wall time."""

    def __init__(self, model) -> None:
        self.seconds = 0.0
        self.layers = [layer.self_attn for layer in model.layers]
        self.originals = [a.attn for a in self.layers]

    def __enter__(self):
        for layer, original in zip(self.layers, self.originals):
            layer.attn = self._timed(original)
        return self

    def __exit__(self, *exc) -> None:
        for layer, original in zip(self.layers, self.originals):
            layer.attn = original

    def _timed(self, attn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            out = attn(*args, **kwargs)
            self.seconds += time.perf_counter() - start
            return out

        return call


def start_decodes(engine, batch: int, context: int, vocab: int) -> list[str]:
    """Put ``batch`` requests straight into the running set, ``context - 1`` tokens computed.

    The K/V of the skipped prefill is whatever the cache holds (random): a decode step costs
    the same whatever the numbers are.
    """
    from engine import SamplingParams
    from engine.request import RequestStatus

    sched, kv = engine.scheduler, engine.kv_cache_manager
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    ids = []
    for i in range(batch):
        rid = f"roofline-{batch}-{i}"
        prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
        engine.add_request(rid, prompt, params)
        request = sched.waiting.pop()
        assert kv.allocate_slots(request, context) is not None, "KV cache too small"
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = context - 1
        sched.running.append(request)
        ids.append(rid)
    return ids


def measure(engine, batch: int, context: int, repeats: int, profile: bool) -> dict:
    """Step time, attention time and floor of one batch size, measured in turns."""
    model = engine.model
    ids = start_decodes(engine, batch, context, engine.hf_config.vocab_size)
    engine.step()  # warm-up: the first step after admission
    dense, own = linear_floor(model, batch)
    with AttentionTimer(model) as timer:
        times = interleaved_medians({"step": engine.step, "floor": dense, "own": own}, repeats)
    attention = timer.seconds / (repeats + 1)
    if profile:
        print_profile(engine, batch)
    for rid in ids:
        engine.abort_request(rid)
    return {"batch": batch, **times, "attention": attention}


def print_profile(engine, batch: int) -> None:
    """torch.profiler's table of one step, by operator, plus time outside any operator."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    print(f"\n--- profile of one step at batch {batch}: {wall * 1e3:.1f} ms wall ---")
    print(events.table(sort_by="self_cpu_time_total", row_limit=25))
    in_ops = sum(e.self_cpu_time_total for e in events) / 1e6
    print(f"time inside aten ops: {in_ops * 1e3:.1f} ms; outside (Python etc.): "
          f"{(wall - in_ops) * 1e3:.1f} ms")  # fmt: skip


def kv_bytes_per_token(engine) -> int:
    """KV cache bytes one token takes over all layers."""
    cache = engine.kv_caches[0]
    per_block = cache[:, 0].numel() * cache.element_size()
    return len(engine.kv_caches) * per_block // engine.config.block_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="print torch.profiler per batch")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="extra EngineConfig field, e.g. attention_backend=torch")  # fmt: skip
    args = ap.parse_args()

    extra = dict(kv.split("=", 1) for kv in args.engine_arg)
    max_batch = max(args.batches)
    # Room for the largest batch's contexts plus the steps measured, one spare block each.
    tokens = max_batch * (args.context + args.repeats + 2 + 16)
    engine = _engine_for(args, extra, tokens, max_batch)
    for cache in engine.kv_caches:
        cache.normal_()  # touch every page: zero pages would make attention look cheap
    rows = [measure(engine, b, args.context, args.repeats, args.profile) for b in args.batches]

    print(
        f"\ndecode step vs matrix-product floor: {args.model}, {args.dtype}, context "
        f"{args.context}, {torch.get_num_threads()} threads, load average "
        f"{open('/proc/loadavg').read().split()[0]}"
    )
    print("floor = F.linear on plain weights; own = the engine's projections + LM head")
    print(
        "| batch | step ms | floor ms | step / floor | own / floor | attention share | tokens/s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['step'] * 1e3:.1f} | {r['floor'] * 1e3:.1f} | "
            f"{r['step'] / r['floor']:.2f} | {r['own'] / r['floor']:.2f} | "
            f"{r['attention'] / r['step']:.0%} | {r['batch'] / r['step']:.0f} |"
        )


def _engine_for(args, extra: dict, tokens: int, max_batch: int):
    from engine import LLMEngine

    probe = LLMEngine(
        model=args.model, dtype=args.dtype, kv_cache_memory="16MiB", max_num_seqs=1, **extra
    )
    per_token = kv_bytes_per_token(probe)
    del probe
    return LLMEngine(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=max_batch,
        kv_cache_memory=tokens * per_token,
        **extra,
    )


if __name__ == "__main__":
    main()
