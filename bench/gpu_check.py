"""The prepared GPU check: pagedq's Triton kernels and engine on a real CUDA device, exact against
Hugging Face, and decode speed against the device's memory roofline. ``bench/gpu_check.sh`` runs
it on a machine with torch, Triton and transformers (the rest carried as wheels).

    python bench/gpu_check.py                   # every part, device cuda (about 5 minutes)
    python bench/gpu_check.py --device cpu --quick   # the same code on the CPU, small sizes

1. exact: tiny random checkpoints of five families (dense, MoE, sinks and windows, latent
   attention, Gated DeltaNet) give Hugging Face's greedy tokens on the device, fp32, on the
   Triton backend and on the torch reference: every Triton kernel the engine runs (paged
   attention, KV writes, MoE, MLA, gated delta, convolution) checked on real hardware.
2. decode: tokens/s of a random ~1 B dense Llama and a random MoE in bf16 at batch 1, 32 and
   256 (128-token prompts, the median of 32 decode steps), each against the roofline: the bytes
   a step must read (the weights it touches, the KV cache it attends) over the bandwidth of a
   device-to-device copy measured here.
3. quant: the Triton weight-only quantized linear (uint4, uint8, fp8) against its torch reference
   at a decode and a prefill shape, and uint4's time against a bf16 ``F.linear`` at M = 1 and
   256 (K = N = 4096). Skipped when ``kernels.triton_quant_linear`` does not import.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [5, 77, 901, 12, 12, 3000, 45, 8, 9, 10, 11] * 3, [42]]
EXACT = {
    "llama": ("llama", {}),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 3,
                                "moe_intermediate_size": 48, "head_dim": 16}),
    "gpt_oss": ("gpt_oss", {"num_local_experts": 6, "num_experts_per_tok": 2,
                            "intermediate_size": 64, "head_dim": 16, "sliding_window": 8,
                            "num_hidden_layers": 3}),
    "deepseek_v3": ("deepseek_v3", {"num_hidden_layers": 3, "first_k_dense_replace": 1,
                                    "num_key_value_heads": 4, "kv_lora_rank": 32,
                                    "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
                                    "v_head_dim": 24, "n_routed_experts": 8,
                                    "num_experts_per_tok": 3, "moe_intermediate_size": 32,
                                    "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
                                    "q_lora_rank": 24}),
    "qwen3_5": ("qwen3_5_text", {"head_dim": 16, "num_hidden_layers": 3,
                                 "layer_types": ["linear_attention", "full_attention",
                                                 "linear_attention"],
                                 "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                 "linear_key_head_dim": 16, "linear_value_head_dim": 16}),
}  # fmt: skip
# Random checkpoints for speed (HF's default init: the values do not matter, ignore_eos).
DENSE = ("llama", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=4096, tie_word_embeddings=False))  # fmt: skip
MOE = ("qwen3_moe", dict(hidden_size=2048, num_hidden_layers=12, num_attention_heads=32,
                         num_key_value_heads=4, head_dim=64, num_experts=32,
                         num_experts_per_tok=8, moe_intermediate_size=512,
                         intermediate_size=4096, max_position_embeddings=4096,
                         tie_word_embeddings=False))  # fmt: skip
QUICK = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- 1. exact ---------------------------------------------------------------------------------
def hf_greedy(folder: str, device: torch.device, n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    outs = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
            outs.append(out[0, len(prompt) :].tolist())
    return outs


def tokenizer(work: Path):
    """The default model's tokenizer, saved once under ``work`` (``gpu_check.sh fetch`` saves it
    where the default model is at hand; the GPU machine reads the copy)."""
    from transformers import AutoTokenizer

    folder = work / "tokenizer"
    if not (folder / "tokenizer_config.json").exists():
        from tiny_models import default_tokenizer

        default_tokenizer().save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def checkpoint(folder: Path, work: Path, model_type: str, config: dict, tiny: bool) -> Path:
    """A random checkpoint with the default tokenizer, made once: ``tiny`` ones as the tests make
    them (fp32, wide weights), the others with HF's own init in bf16."""
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = tokenizer(work)
    if tiny:
        from tiny_models import tiny_hf_model

        model = tiny_hf_model(model_type, vocab_size=len(tok), **config)
    else:
        hf_config = AutoConfig.for_model(model_type, vocab_size=len(tok), **config)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def check_exact(work: Path, device: torch.device, n: int = 16) -> bool:
    """Each family's greedy tokens on both backends against HF's; prints one line each."""
    from engine import LLM, SamplingParams

    ok = True
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    backends = ("triton", "torch") if device.type == "cuda" else ("auto", "torch")
    for name, (model_type, overrides) in EXACT.items():
        folder = checkpoint(work / "exact" / name, work, model_type, overrides, tiny=True)
        want = hf_greedy(str(folder), device, n)
        for backend in backends:
            llm = LLM(str(folder), device=str(device), dtype="float32", attention_backend=backend,
                      kv_cache_memory="64MiB", block_size=16)  # fmt: skip
            got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            same = sum(g == w for g, w in zip(got, want))
            ok &= same == len(PROMPTS)
            verdict = "PASS" if same == len(PROMPTS) else "FAIL"
            print(f"exact  {name:<12} {backend:<7} {verdict} {same}/{len(PROMPTS)} prompts")
            del llm
    return ok


# --- 2. decode --------------------------------------------------------------------------------
def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written (best of 5)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def step_bytes(net, batch: int, context: int, elem: int) -> float:
    """Bytes one decode step must read: every weight a step touches (an MoE's routed experts by
    the expected number of distinct experts ``batch`` tokens pick) and the KV of ``context``
    tokens per sequence."""
    total = 0.0
    for module in net.modules():  # weights held packed for the CPU GEMM (not parameters)
        packed = getattr(module, "packed", None)
        if isinstance(packed, torch.Tensor):
            total += packed.numel() * packed.element_size()
    for name, p in net.named_parameters():
        if "embed_tokens" in name:
            continue  # one row per token
        nbytes = p.numel() * p.element_size()
        experts = getattr(p, "num_experts", None) or (p.shape[0] if p.dim() == 3 else None)
        if experts:
            top_k = net.config.num_experts_per_tok
            nbytes *= 1 - (1 - top_k / experts) ** batch
        total += nbytes
    for spec in net.kv_cache_specs():
        total += batch * context * 2 * spec.num_kv_heads * spec.head_dim * elem
    return total


def decode_speed(folder: Path, device: torch.device, batches, steps: int, bandwidth: float):
    """Per batch size: (tokens/s, roofline tokens/s) of bf16 decode steps."""
    from engine import LLM, SamplingParams

    llm = LLM(str(folder), device=str(device), dtype="bfloat16", max_num_seqs=max(batches),
              max_num_batched_tokens=8192, enable_prefix_caching=False)  # fmt: skip
    engine, net = llm.llm_engine, llm.llm_engine.model
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:
        params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
        for i in range(batch):
            prompt = torch.randint(3, 40000, (128,), generator=gen).tolist()
            engine.add_request(f"{batch}-{i}", prompt, params)
        times = []
        while engine.has_unfinished_requests():
            sync(device)
            start = time.perf_counter()
            outs = engine.step()
            sync(device)
            elapsed = time.perf_counter() - start
            # A pure decode step: every request past its prompt (none finished in it).
            if all(len(o.outputs[0].token_ids) > 1 for o in outs) and len(outs) == batch:
                times.append(elapsed)
        step_s = statistics.median(times[1:] or times)
        roof_s = step_bytes(net, batch, 128 + steps // 2, 2) / bandwidth
        rows.append((batch, batch / step_s, batch / roof_s))
    del llm
    return rows


# --- 3. quant ---------------------------------------------------------------------------------
def quant_weight(weight_type: str, n: int, k: int, group_size: int, device, gen):
    """A random packed weight ``(qweight, scales, zeros)`` whose values are about k ** -0.5
    (symmetric zeros for the integer types, none for fp8)."""
    from kernels.quant_linear import pack_uint4

    groups = (n, k // group_size)
    if weight_type == "float8_e4m3fn":
        spread, zeros = 4, None
        qweight = (torch.randn(n, k, generator=gen) * spread).to(torch.float8_e4m3fn)
    else:
        spread = 8 if weight_type == "uint4" else 128
        qweight = torch.randint(0, 2 * spread, (n, k), generator=gen, dtype=torch.uint8)
        qweight = pack_uint4(qweight) if weight_type == "uint4" else qweight
        zeros = torch.full(groups, float(spread), device=device)
    scales = (torch.rand(groups, generator=gen) + 0.5) / (spread * k**0.5)
    return qweight.to(device), scales.to(device), zeros


def kernel_ms(fn, device: torch.device) -> float:
    """Median ms of ``fn()``: on CUDA Triton's ``do_bench``, which flushes L2 between calls (each
    reads its weight from memory, as a layer in a model does)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def check_quant_linear(device: torch.device, quick: bool) -> bool:
    """``triton_quant_linear`` against the reference (relative max error, fp32 and bf16 out),
    then uint4 against a bf16 ``F.linear``; prints one line each."""
    try:
        from kernels.quant_linear import WEIGHT_TYPES, quant_linear_reference
        from kernels.triton_common import interpreting
        from kernels.triton_quant_linear import triton_quant_linear
    except Exception as exc:  # not written yet, or Triton failing at import
        print(f"quant  skipped: {type(exc).__name__}: {exc}")
        return True
    if device.type != "cuda" and not interpreting():
        print("quant  skipped: Triton needs CUDA (or TRITON_INTERPRET=1)")
        return True
    gen = torch.Generator().manual_seed(0)
    k, n, group_size = (256, 80, 64) if quick else (2048, 1104, 128)  # N off every block size
    ok = True
    for weight_type in WEIGHT_TYPES:
        w = quant_weight(weight_type, n, k, group_size, device, gen)
        bias = torch.randn(n, generator=gen).to(device, torch.bfloat16)
        for m in (1, 33 if quick else 300):
            x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
            want = quant_linear_reference(x.float(), *w, weight_type, group_size, bias)
            errs = []  # bf16 x with fp32 out, bf16 x with bf16 out, fp32 x
            for x_in, out_dtype in ((x, torch.float32), (x, None), (x.float(), None)):
                got = triton_quant_linear(x_in, *w, weight_type, group_size, bias, out_dtype)
                errs.append(((got.float() - want).abs().max() / want.abs().max()).item())
            # fp32 results differ by summation order only; a bf16 one by one rounding step.
            passed = errs[0] < 1e-5 and errs[1] < 2**-7 and errs[2] < 1e-5
            ok &= passed
            print(
                f"quant  {weight_type:<13} M={m:<4} {'PASS' if passed else 'FAIL'} error: bf16 x "
                f"{errs[0]:.1e} (fp32 out) {errs[1]:.1e} (bf16 out), fp32 x {errs[2]:.1e}"
            )
    size = 512 if quick else 4096
    w = quant_weight("uint4", size, size, 128, device, gen)
    dense = (torch.randn(size, size, generator=gen) * size**-0.5).to(device, torch.bfloat16)
    for m in (1, 256):
        x = torch.randn(m, size, generator=gen).to(device, torch.bfloat16)
        quant_ms = kernel_ms(lambda x=x: triton_quant_linear(x, *w, "uint4", 128), device)
        dense_ms = kernel_ms(lambda x=x: torch.nn.functional.linear(x, dense), device)
        print(
            f"quant  uint4 M={m:<4} K=N={size}: {quant_ms * 1e3:8.1f} us, bf16 linear "
            f"{dense_ms * 1e3:8.1f} us, ratio {quant_ms / dense_ms:.2f}x"
        )
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--work-dir", default=str(ROOT / ".gpu_check"), help="checkpoints go here")
    ap.add_argument("--parts", default="exact,quant,decode", help="exact, quant, decode, tokenizer")
    ap.add_argument("--quick", action="store_true", help="small models (a CPU run of the code)")
    args = ap.parse_args()
    device = torch.device(args.device)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    ok = True
    start = time.perf_counter()
    if "tokenizer" in args.parts:  # gpu_check.sh fetch: only save it
        tokenizer(work)
    if "exact" in args.parts:
        ok &= check_exact(work, device)
    if "quant" in args.parts:
        ok &= check_quant_linear(device, args.quick)
    if "decode" in args.parts:
        bandwidth = copy_bandwidth(device, 1 << (26 if args.quick else 30))
        print(f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s (read + written)")
        batches, steps = ((1, 4), 4) if args.quick else ((1, 32, 256), 32)
        print(f"{'model':<10} {'batch':>5} {'tokens/s':>10} {'roofline':>10} {'of roofline':>12}")
        for name, (model_type, config) in (("dense-1B", DENSE), ("moe", MOE)):
            if args.quick:
                config = {**config, **QUICK}
            folder = work / f"{name}{'-quick' if args.quick else ''}"
            checkpoint(folder, work, model_type, config, tiny=False)
            for batch, tps, roof in decode_speed(folder, device, batches, steps, bandwidth):
                print(f"{name:<10} {batch:>5} {tps:>10.0f} {roof:>10.0f} {tps / roof:>11.0%}")
    print(f"gpu check {'PASSED' if ok else 'FAILED'} in {time.perf_counter() - start:.0f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
