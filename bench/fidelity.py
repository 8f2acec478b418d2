"""How faithful each dtype is to fp32, for pagedq and for Hugging Face, side by side.

    python bench/fidelity.py                  # the default model and two random families, bf16
    python bench/fidelity.py --models smollm2 --dtype bfloat16,float16 --max-tokens 64
    python bench/fidelity.py --models DIR     # any model folder both can load

``--models`` takes model names or folders, and ``random:FAMILY`` for a small random checkpoint of
a family (``random:qwen3_moe``: 16 experts, 4 per token; ``random:qwen3_5_text``: Gated DeltaNet
and gated attention layers), made once under ``~/.cache/pagedq/bench/fidelity`` and prompted
with ``--random-prompts`` prompts of random tokens (a random model's greedy answer leaves fp32's
after a few tokens: many prompts make "kept" a measurement rather than a draw).

The reference is Hugging Face in fp32 (pagedq's fp32 is token-exact against it: tests/engine).
For each dtype and each engine, on the same weights and prompts (greedy):
  kept    fp32 tokens kept before the first divergence from fp32's answer, summed over prompts
  whole   answers identical to fp32's (to EOS or ``--max-tokens``)
  KL      mean KL(fp32 || dtype) of the next-token distribution over fp32's answers, teacher
          forced (every prompt with its fp32 answer appended, one forward; nats per token)
pagedq's teacher-forced logits come from one prefill per sequence (prefix caching off, no
chunking); its greedy answers run through the engine as a user runs it (decode steps included).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "What is the capital of France?",
    "Name three fruits that are red.",
    "How many legs does a spider have?",
    "What is the opposite of cold?",
    "Write one sentence about autumn leaves.",
    "What language is spoken in Brazil?",
    "Give two tips for sleeping better.",
    "What is the chemical symbol for gold?",
    "Who painted the Mona Lisa?",
    "Convert 3 kilometers to meters.",
    "What is a prime number? Explain briefly.",
    "Write a short slogan for a bakery.",
    "Why do we have seasons on Earth?",
    "What are the three states of matter?",
    "Describe the taste of a lemon.",
    "How do bees make honey?",
    "Summarize the plot of Cinderella in two sentences.",
    "What is the difference between weather and climate?",
    "Write a polite email declining a meeting invitation for Friday afternoon because of a "
    "scheduling conflict, and propose two alternative times next week.",
    "Explain to a ten-year-old how a rainbow forms after a storm, using simple words and one "
    "everyday example they can try at home with a glass of water.",
    "List five things a traveller should pack for a week-long hiking trip in the mountains "
    "during early spring, and say briefly why each one matters.",
    "A farmer has 17 sheep and all but 9 run away. How many sheep does the farmer have left? "
    "Think it through step by step before giving the final answer.",
    "Compare cats and dogs as pets for someone who lives alone in a small city apartment and "
    "works long hours, covering cost, space, exercise and companionship.",
    "You are a helpful assistant for a library. A visitor asks where to find books about "
    "ancient Rome, whether they can borrow e-books from home, and how late the library is "
    "open on Saturdays. Answer each question clearly.",
]


# Small random checkpoints: (model_type, config overrides of tests/tiny_models.py's TINY).
SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=2048)  # fmt: skip
RANDOM = {
    "llama": SMALL,
    "qwen3_moe": {**SMALL, "num_experts": 16, "num_experts_per_tok": 4,
                  "moe_intermediate_size": 128, "norm_topk_prob": True},
    "qwen3_5_text": {**SMALL, "layer_types": ["linear_attention", "full_attention"] * 2,
                     "linear_num_key_heads": 4, "linear_num_value_heads": 8,
                     "linear_key_head_dim": 32, "linear_value_head_dim": 32},
}  # fmt: skip
DEFAULT_MODELS = "smollm2,random:qwen3_moe,random:qwen3_5_text"
RANDOM_DIR = Path.home() / ".cache" / "pagedq" / "bench" / "fidelity"


def random_checkpoint(family: str) -> str:
    """The folder of ``RANDOM[family]``'s random checkpoint, made on first use."""
    import json

    if family not in RANDOM:
        raise SystemExit(f"random:{family} is not known: must be one of {sorted(RANDOM)}")
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import make_tiny_model

    folder = RANDOM_DIR / family
    stamp, want = folder / "bench_config.json", json.dumps(RANDOM[family], sort_keys=True)
    if not stamp.exists() or stamp.read_text() != want:
        make_tiny_model(folder, family, **RANDOM[family])
        stamp.write_text(want)
    return str(folder)


def chat_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Each prompt as one user turn with the model's chat template."""
    out = []
    for text in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def random_ids(n: int, vocab: int) -> list[list[int]]:
    """``n`` seeded prompts of random tokens, 8-64 long: a random model's answers diverge after
    a few tokens, so its "kept" needs many prompts to say more than chance."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 65, (n,), generator=gen).tolist()
    return [torch.randint(3, vocab, (m,), generator=gen).tolist() for m in lengths]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def mean_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over rows of KL(softmax(ref) || softmax(logits)), in fp32."""
    ref = torch.log_softmax(ref_logits.float(), -1)
    other = torch.log_softmax(logits.float(), -1)
    return (ref.exp() * (ref - other)).sum(-1).mean().item()


# --- Hugging Face ---------------------------------------------------------------------------
def hf_model(folder: str, dtype: torch.dtype):
    """Hugging Face's own model for ``folder`` in ``dtype`` (eager: the reference's numerics)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def hf_greedy(model, prompts: list[list[int]], max_tokens: int, eos: set[int]) -> list[list[int]]:
    """Hugging Face greedy answers, one prompt at a time (no padding), EOS included."""
    answers = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=sorted(eos),
                pad_token_id=0,
            )
            answers.append(out[0, len(ids) :].tolist())
    return answers


def hf_logits(model, prompts: list[list[int]], answers: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence, fp32 logits ``[len(answer), vocab]`` predicting each answer token."""
    out = []
    with torch.inference_mode():
        for ids, ans in zip(prompts, answers):
            logits = model(torch.tensor([ids + ans])).logits[0].float()
            out.append(logits[len(ids) - 1 : len(ids) + len(ans) - 1])
    return out


# --- pagedq ---------------------------------------------------------------------------------
def pagedq_llm(model: str, dtype: str, **kwargs):
    """An engine for teacher forcing and greedy answers: no prefix caching, no chunking."""
    from engine import LLM

    kwargs.setdefault("kv_cache_memory", "512MiB")
    return LLM(
        model, dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=4096, **kwargs
    )


def pagedq_greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """pagedq's greedy answers, all prompts in one continuous batch."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def pagedq_logits(llm, prompts: list[list[int]], answers: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence, pagedq's fp32 logits predicting each answer token: the hidden states of
    one prefill of prompt + answer, through the model's own ``compute_logits``."""
    from engine import SamplingParams

    net = llm.llm_engine.model
    captured: list[torch.Tensor] = []
    forward = net.forward

    def capture(*args, **kwargs):
        hidden = forward(*args, **kwargs)
        captured.append(hidden.clone())
        return hidden

    net.forward = capture
    out = []
    try:
        with torch.inference_mode():
            for ids, ans in zip(prompts, answers):
                captured.clear()
                llm.generate(
                    [ids + ans], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False
                )
                (hidden,) = captured  # one prefill step
                rows = hidden[len(ids) - 1 : len(ids) + len(ans) - 1]
                out.append(net.compute_logits(rows).float())
    finally:
        del net.forward
    return out


# --- the comparison -------------------------------------------------------------------------
def score(reference: list[list[int]], answers: list[list[int]], ref_logits, logits) -> dict:
    """kept / whole / KL of one engine at one dtype against the fp32 reference."""
    return {
        "kept": sum(common_prefix(r, a) for r, a in zip(reference, answers)),
        "whole": sum(r == a for r, a in zip(reference, answers)),
        "kl": sum(mean_kl(r, x) for r, x in zip(ref_logits, logits)) / len(logits),
    }


def compare(model: str, folder: str, prompts, dtypes: list[str], max_tokens: int, eos) -> dict:
    """``{dtype: {"hf": score, "pagedq": score}}`` against HF fp32, plus ``"total"``."""
    ref_model = hf_model(folder, torch.float32)
    reference = hf_greedy(ref_model, prompts, max_tokens, eos)
    ref_logits = hf_logits(ref_model, prompts, reference)
    del ref_model
    results: dict = {"total": sum(len(r) for r in reference), "prompts": len(prompts)}
    for name in dtypes:
        dtype = getattr(torch, name)
        hf = hf_model(folder, dtype)
        row = {
            "hf": score(
                reference,
                hf_greedy(hf, prompts, max_tokens, eos),
                ref_logits,
                hf_logits(hf, prompts, reference),
            )
        }
        del hf
        llm = pagedq_llm(model, name)
        row["pagedq"] = score(
            reference,
            pagedq_greedy(llm, prompts, max_tokens),
            ref_logits,
            pagedq_logits(llm, prompts, reference),
        )
        del llm
        results[name] = row
    return results


def print_table(model: str, results: dict, dtypes: list[str]) -> None:
    """One row per dtype and engine."""
    total, n = results["total"], results["prompts"]
    print(f"\n{model}: reference Hugging Face fp32, {n} prompts, {total} answer tokens")
    print(f"{'dtype':<10} {'engine':<8} {'kept':>12} {'whole':>8} {'KL (nats/token)':>16}")
    for name in dtypes:
        for engine in ("hf", "pagedq"):
            s = results[name][engine]
            kept = f"{s['kept']}/{total}"
            print(f"{name:<10} {engine:<8} {kept:>12} {s['whole']:>4}/{n:<3} {s['kl']:>16.5f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help="comma list (see above)")
    parser.add_argument("--dtype", default="bfloat16", help="comma list: bfloat16, float16")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="use the first N")
    parser.add_argument(
        "--random-prompts", type=int, default=96, help="random-token prompts for random models"
    )
    args = parser.parse_args()
    from engine.model_loader import (
        cached_source,
        generation_eos_token_ids,
        load_tokenizer,
        resolve_model,
    )

    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    start = time.perf_counter()
    for model in (m.strip() for m in args.models.split(",") if m.strip()):
        if model.startswith("random:"):
            model = random_checkpoint(model.removeprefix("random:"))
        source = cached_source(resolve_model(model))
        tokenizer = load_tokenizer(source)
        eos = set(generation_eos_token_ids(source.folder)) | {tokenizer.eos_token_id}
        max_tokens = args.max_tokens
        if model.startswith(str(RANDOM_DIR)):
            prompts = random_ids(args.random_prompts, len(tokenizer))
            max_tokens = min(max_tokens, 48)  # its answers leave fp32's long before
        else:
            prompts = chat_ids(tokenizer, PROMPTS[: args.prompts])
        results = compare(model, source.folder, prompts, dtypes, max_tokens, eos)
        print_table(model, results, dtypes)
    print(f"({time.perf_counter() - start:.0f} s; torch threads {torch.get_num_threads()})")


if __name__ == "__main__":
    main()
