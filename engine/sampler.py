"""Batched sampling: penalties, greedy, temperature, top-k, top-p, min-p, seeds, logprobs."""

from __future__ import annotations

import torch

from engine.request import Request
from kernels import argmax

MIN_TEMPERATURE = 1e-5
inf = float("inf")


class Sampler:
    """Picks one token per row of logits, each row under its own request's parameters."""

    def __init__(self, device: torch.device, seed: int = 0, backend: str = "auto") -> None:
        self.device = device
        self.backend = backend  # the engine's kernel backend: the CPU one has a parallel argmax
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @staticmethod
    def plain_greedy(requests: list[Request]) -> bool:
        """True when every row is an argmax of its raw logits (nothing changes or reads them)."""
        return all(_plain_greedy(r) for r in requests)

    def __call__(self, logits: torch.Tensor, requests: list[Request], eos_ids: set[int]):
        """Returns the sampled token ids and, per row, a logprobs dict or None."""
        if self.plain_greedy(requests):
            # The common batch: no sort, no softmax, no copies; one argmax over the logits.
            return argmax(logits, self.backend).tolist(), [None] * len(requests)
        raw_logprobs = self._logprobs_source(logits, requests)
        logits = self._apply_penalties(logits, requests)
        logits = self._apply_logit_bias(logits, requests)
        logits = self._apply_min_tokens(logits, requests, eos_ids)
        sampled = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        random = [i for i, r in enumerate(requests) if not r.params.greedy]
        if greedy:
            idx = torch.tensor(greedy, device=logits.device)
            sampled[idx] = argmax(logits[idx], self.backend)
        if random:
            idx = torch.tensor(random, device=logits.device)
            sampled[idx] = self._sample(logits[idx], [requests[i] for i in random])
        token_ids = sampled.tolist()
        return token_ids, self._gather_logprobs(raw_logprobs, requests, token_ids)

    @staticmethod
    def _logprobs_source(logits, requests):
        if all(r.params.logprobs is None for r in requests):
            return None
        return torch.log_softmax(logits, dim=-1)

    @staticmethod
    def _gather_logprobs(logprobs, requests, token_ids):
        if logprobs is None:
            return [None] * len(requests)
        out = []
        for i, r in enumerate(requests):
            k = r.params.logprobs
            if k is None:
                out.append(None)
                continue
            entry = {token_ids[i]: float(logprobs[i, token_ids[i]])}
            if k:
                values, ids = logprobs[i].topk(k)
                # A grammar may allow fewer than k tokens: the forbidden ones are not offered.
                entry.update((t, v) for t, v in zip(ids.tolist(), values.tolist()) if v > -inf)
            out.append(entry)
        return out

    @staticmethod
    def _apply_penalties(logits, requests):
        rep = [r.params.repetition_penalty for r in requests]
        pres = [r.params.presence_penalty for r in requests]
        freq = [r.params.frequency_penalty for r in requests]
        if all(p == 1.0 for p in rep) and not any(pres) and not any(freq):
            return logits
        logits = logits.clone()
        device, vocab = logits.device, logits.shape[1]
        for i, r in enumerate(requests):
            if rep[i] != 1.0:
                # Hugging Face's rule over prompt and output: shrink positive logits, grow negative.
                seen = torch.tensor(sorted(set(r.all_token_ids)), device=device)
                seen = seen[seen < vocab]
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / rep[i], vals * rep[i])
            if (pres[i] or freq[i]) and r.num_output_tokens:
                out_ids = torch.tensor(r.output_token_ids, device=device)
                counts = torch.zeros(vocab, device=device).scatter_add_(
                    0, out_ids, torch.ones_like(out_ids, dtype=torch.float)
                )
                logits[i] -= freq[i] * counts + pres[i] * (counts > 0).float()
        return logits

    @staticmethod
    def _apply_logit_bias(logits, requests):
        """OpenAI's logit_bias: each listed token's logit plus its bias (ids past the model's
        vocabulary can never be sampled, so their bias changes nothing)."""
        rows = [i for i, r in enumerate(requests) if r.params.logit_bias]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in rows:
            bias = {t: b for t, b in requests[i].params.logit_bias.items() if 0 <= t < vocab}
            if bias:
                ids = torch.tensor(list(bias), device=logits.device)
                values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
                logits[i, ids] += values
        return logits

    @staticmethod
    def _apply_min_tokens(logits, requests, eos_ids):
        rows = [i for i, r in enumerate(requests) if r.num_output_tokens < r.params.min_tokens]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in rows:
            banned = set(requests[i].params.stop_token_ids or [])
            if not requests[i].params.ignore_eos:
                banned |= eos_ids
            # A stop id outside the vocabulary can never be sampled: nothing to ban.
            banned = [t for t in banned if 0 <= t < vocab]
            if banned:
                row = logits[i, banned].clone()
                logits[i, banned] = float("-inf")
                # A grammar that allows only EOS ends the request by itself: keep it possible.
                if bool(torch.isneginf(logits[i]).all()):
                    logits[i, banned] = row
        return logits

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        device = logits.device
        temps = torch.tensor([r.params.temperature for r in requests], device=device)
        # A tiny temperature would overflow the scaled logits to inf (NaN probabilities).
        logits = logits / temps.clamp(min=MIN_TEMPERATURE)[:, None]
        top_k = [r.params.top_k for r in requests]
        top_p = [r.params.top_p for r in requests]
        if any(top_k) or any(p < 1.0 for p in top_p):
            logits = _top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        min_p = torch.tensor([r.params.min_p for r in requests], device=device)
        if bool((min_p > 0).any()):
            threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
            probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
        return self._exponential_race(probs, requests)

    def _exponential_race(self, probs, requests):
        # argmax(p / E) with E ~ Exp(1) draws from p; each seeded request draws its noise
        # from its own generator, so its tokens do not depend on the rest of the batch.
        noise = torch.empty_like(probs)
        unseeded = []
        for i, r in enumerate(requests):
            if r.params.seed is None:
                unseeded.append(i)
                continue
            if r.generator is None:
                r.generator = torch.Generator(device=probs.device).manual_seed(r.params.seed)
            noise[i].exponential_(generator=r.generator)
        if unseeded:
            idx = torch.tensor(unseeded, device=probs.device)
            noise[idx] = torch.empty(
                len(unseeded), probs.shape[1], device=probs.device
            ).exponential_(generator=self.generator)
        return (probs / noise).argmax(dim=-1)


def _plain_greedy(r: Request) -> bool:
    """Greedy with nothing that changes or reads the logits first (penalties, min_tokens,
    logprobs)."""
    p = r.params
    return (
        p.temperature == 0
        and p.logprobs is None
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
        and not p.logit_bias
        and r.num_output_tokens >= p.min_tokens
    )


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    # top_k of 0, or past the vocabulary, keeps every token.
    k = torch.tensor([t if 0 < t < vocab else vocab for t in top_k], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    p = torch.tensor(top_p, device=logits.device)
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches p: drop a token if the mass before it does.
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
