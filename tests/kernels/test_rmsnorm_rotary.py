"""Fused residual-add RMSNorm and rotary embedding equal their references (and the engine's)."""

import pytest
import torch
from kernel_batch import rel_err

from kernels.triton_rmsnorm import rms_norm_torch, rms_norm_triton
from kernels.triton_rotary import rotary_torch, rotary_triton

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize(
    "hidden,dtype,with_residual",
    [(64, torch.float32, True), (576, torch.bfloat16, True), (96, torch.bfloat16, False),
     (128, torch.float32, False)],
)  # fmt: skip
def test_rms_norm_matches_reference(rng, hidden, dtype, with_residual):
    x = (torch.randn(7, hidden, generator=rng) * 3).to(dtype)
    weight = torch.randn(hidden, generator=rng).to(dtype)
    residual = torch.randn(7, hidden, generator=rng).to(dtype) if with_residual else None
    expected, expected_residual = rms_norm_torch(x, weight, 1e-6, residual)
    actual_residual = residual.clone() if with_residual else None
    actual, returned = rms_norm_triton(x, weight, 1e-6, actual_residual)
    assert rel_err(actual, expected) < TOLERANCE[dtype]
    if with_residual:
        assert returned is actual_residual
        assert torch.equal(actual_residual, expected_residual)  # one rounded add: exact
    else:
        assert returned is None


def test_rms_norm_reference_is_the_engine_layer():
    from engine.models.norm import RMSNorm

    # The torch backend's layer; the C++ one sums in its own vector order (test_layers_cpu.py
    # bounds that difference): bit-equal to torch only where both use the same lane count.
    layer = RMSNorm(64, 1e-5, backend="torch")
    torch.nn.init.normal_(layer.weight)
    x = torch.randn(5, 64)
    assert torch.equal(rms_norm_torch(x, layer.weight, 1e-5)[0], layer(x))


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,dtype",
    [(4, 2, 64, torch.float32), (6, 2, 128, torch.bfloat16), (3, 1, 80, torch.float32)],
)
def test_rotary_matches_reference(rng, num_heads, num_kv_heads, head_dim, dtype):
    max_position = 64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_position).float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    positions = torch.randint(max_position, (9,), generator=rng)
    # q and k as the model has them: views into one fused qkv projection.
    qkv = torch.randn(9, num_heads + 2 * num_kv_heads, head_dim, generator=rng).to(dtype)
    query, key = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    expected_q, expected_k = rotary_torch(positions, query, key, cos, sin)
    value_before = qkv[:, num_heads + num_kv_heads :].clone()
    actual_q, actual_k = rotary_triton(positions, query, key, cos, sin)
    assert actual_q.data_ptr() == query.data_ptr()  # in place
    assert rel_err(actual_q, expected_q) < TOLERANCE[dtype]
    assert rel_err(actual_k, expected_k) < TOLERANCE[dtype]
    assert torch.equal(qkv[:, num_heads + num_kv_heads :], value_before)  # v untouched


def test_rotary_reference_is_the_engine_layer():
    from transformers import LlamaConfig

    from engine.models.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=2), 32, 128)
    positions = torch.tensor([0, 5, 127])
    q, k = torch.randn(3, 2, 32), torch.randn(3, 1, 32)
    got = rotary_torch(positions, q, k, rotary.cos, rotary.sin)
    want = rotary(positions, q, k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_rotary_tables_grow_to_the_positions_a_step_needs():
    """A 10M-position model (Llama 4 Scout) gets no 10 GB table at load: the tables start at
    ``INITIAL_POSITIONS`` and grow, with the values a whole table holds."""
    from transformers import LlamaConfig

    from engine.models.rotary import INITIAL_POSITIONS, RotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=2)
    lazy = RotaryEmbedding(config, 32, 10_000_000)
    assert lazy.cos.shape[0] == INITIAL_POSITIONS
    positions = torch.tensor([3, INITIAL_POSITIONS + 5, 3 * INITIAL_POSITIONS])
    cos, sin = lazy.cos_sin(positions, torch.float32)
    assert lazy.cos.shape[0] == 3 * INITIAL_POSITIONS + 1  # grown to what was needed
    whole = RotaryEmbedding(config, 32, 3 * INITIAL_POSITIONS + 1)
    whole.cos, whole.sin = whole._table(whole.inv_freq, 3 * INITIAL_POSITIONS + 1)
    want_cos, want_sin = whole.cos_sin(positions, torch.float32)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
