"""OpenAI's logit_bias in the sampler, against a reference: the same draw from logits + bias."""

from __future__ import annotations

import pytest
import torch

from engine.request import Request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams


def _sample(params: SamplingParams, logits: torch.Tensor) -> int:
    request = Request("r", [1, 2, 3], params)
    token_ids, _ = Sampler(torch.device("cpu"))(logits[None, :], [request], eos_ids={0})
    return token_ids[0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_biased_draws_equal_draws_from_biased_logits(temperature):
    logits = torch.randn(200, generator=torch.Generator().manual_seed(0))
    bias = {int(logits.argmin()): 100.0, int(logits.argmax()): -100.0, 7: 2.5, 10**6: 50.0}
    reference = logits.clone()
    for token_id, value in bias.items():
        if token_id < len(logits):
            reference[token_id] += value
    for seed in range(5):
        biased = _sample(
            SamplingParams(temperature=temperature, seed=seed, logit_bias=bias), logits
        )
        assert biased == _sample(SamplingParams(temperature=temperature, seed=seed), reference)
    assert _sample(SamplingParams(temperature=0, logit_bias=bias), logits) == int(logits.argmin())


def test_bad_biases_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
