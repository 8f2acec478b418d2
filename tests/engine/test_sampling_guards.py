"""SamplingParams refuses what would crash the sampler; the sampler tolerates the edges."""

from __future__ import annotations

import pytest
import torch

from engine.request import Request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": float("inf")}, "temperature=inf is invalid: must be a finite number"),
        ({"temperature": float("nan")}, "temperature=nan is invalid: must be a finite number"),
        ({"top_p": float("nan")}, "top_p=nan is invalid"),
        ({"presence_penalty": float("-inf")}, "presence_penalty=-inf is invalid"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty=inf is invalid"),
        ({"top_k": 2**63}, "top_k=9223372036854775808 is invalid: must be an integer in [0, "),
        ({"top_k": True}, "top_k=True is invalid"),
        ({"n": 2000}, "n=2000 is invalid: must be an integer in [1, 1024]"),
        ({"max_tokens": 2**63}, "max_tokens=9223372036854775808 is invalid"),
        ({"max_tokens": 8.0}, "max_tokens=8.0 is invalid"),
        ({"seed": 2**63 - 1}, "seed=9223372036854775807 is invalid"),
        ({"logprobs": 21}, "logprobs=21 is invalid: must be an integer in [0, 20]"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids=[18446744073709551616] is invalid"),
        ({"stop_token_ids": [True]}, "stop_token_ids=[True] is invalid"),
        ({"ignore_eos": 1}, "ignore_eos=1 is invalid: must be a boolean"),
    ],
)
def test_values_that_would_crash_the_sampler_are_refused(fields, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**fields)
    assert message in str(err.value)


def _sample(params: SamplingParams, logits: torch.Tensor, num_output: int = 0) -> int:
    request = Request("r", [1, 2, 3], params)
    for _ in range(num_output):
        request.append_output_token(4)
    token_ids, _ = Sampler(torch.device("cpu"))(logits[None, :], [request], eos_ids={0})
    return token_ids[0]


def test_top_k_past_the_vocabulary_is_the_same_as_off():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    big = _sample(SamplingParams(temperature=1.0, top_k=2**62, seed=7), logits)
    off = _sample(SamplingParams(temperature=1.0, top_k=0, seed=7), logits)
    assert big == off


def test_stop_ids_past_the_vocabulary_are_ignored_by_min_tokens():
    logits = torch.zeros(100)
    logits[5] = 10.0
    params = SamplingParams(temperature=0, stop_token_ids=[10**9, 5], min_tokens=2)
    assert _sample(params, logits) != 5  # 5 is banned until min_tokens; 10**9 does not crash


def test_a_tiny_temperature_still_samples_the_top_token():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(1))
    token = _sample(SamplingParams(temperature=1e-300, seed=3), logits)
    assert token == int(logits.argmax())
