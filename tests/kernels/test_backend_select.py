""" "auto" picks Triton on CUDA, the C++ kernels on the CPU, and the torch reference elsewhere."""

import pytest
import torch

import kernels
import kernels.triton_attention
import kernels.triton_kv_write
from kernels import select_backend


def test_auto_selects_triton_on_cuda_without_a_gpu():
    assert select_backend("cuda") == "triton"
    assert select_backend(torch.device("cuda", 1)) == "triton"


def test_auto_selects_the_cpu_kernels_on_cpu_and_torch_elsewhere():
    expected = "cpu" if kernels.cpu_attention.cpu_kernels_available() else "torch"
    assert select_backend("cpu") == expected
    assert select_backend(torch.device("meta")) == "torch"


def test_auto_on_cuda_falls_back_to_torch_without_triton(monkeypatch):
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    assert select_backend("cuda") == "torch"


def test_explicit_backend_wins():
    assert select_backend("cpu", "triton") == "triton"
    assert select_backend("cuda", "torch") == "torch"


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="'cudnn'"):
        select_backend("cuda", "cudnn")


def _refuse(*args, **kwargs):
    raise AssertionError("the Triton kernel ran for CPU tensors with backend='auto'")


def test_entry_points_with_cpu_tensors_use_torch(monkeypatch):
    monkeypatch.setattr(kernels.triton_kv_write, "write_kv_triton", _refuse)
    monkeypatch.setattr(kernels.triton_attention, "unified_attention_triton", _refuse)
    kv_cache = torch.zeros(2, 2, 16, 1, 64)
    key = torch.ones(2, 1, 64)
    kernels.write_kv(key, key, kv_cache, torch.tensor([0, 1]))
    assert kv_cache[:, 0, :2].eq(1).all()
    query = torch.randn(2, 2, 64)
    out = kernels.unified_attention(
        query, kv_cache, torch.tensor([0, 2]), torch.tensor([2]), torch.tensor([[0, 1]]), 0.125
    )
    # Both keys and values are all ones, so every output is exactly one.
    assert torch.allclose(out, torch.ones_like(out))
