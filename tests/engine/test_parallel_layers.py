"""The tensor-parallel layers at two ranks (gloo, one thread each) give the unsharded layer's
output, each rank loading its slice from the whole checkpoint tensor and holding half of it; a
rank that dies before it joins the group is named at once."""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from engine.models.linear import load_param
from engine.parallel.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from engine.parallel.ranks import RankFailure, RankGroup, free_port
from engine.parallel.state import destroy_tensor_parallel, init_tensor_parallel, tp_rank

HIDDEN, INTER, VOCAB, HEAD_DIM = 64, 96, 101, 16  # a vocabulary that 2 ranks do not divide


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # fp32 sums in another order (a row-parallel sum is two partial sums added).
    assert got.shape == want.shape, (got.shape, want.shape)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()


def _rank_checks(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    init_tensor_parallel(rank, 2, f"tcp://127.0.0.1:{port}", backend="gloo")
    try:
        _check_layers(rank)
    finally:
        destroy_tensor_parallel()


@torch.inference_mode()
def _check_layers(rank: int) -> None:
    gen = torch.Generator().manual_seed(0)  # the same "checkpoint" on every rank
    x = torch.randn(5, HIDDEN, generator=gen)

    # Column then row: the MLP's shape, one all-reduce.
    w_up, w_down = (
        torch.randn(INTER, HIDDEN, generator=gen),
        torch.randn(HIDDEN, INTER, generator=gen),
    )
    b_down = torch.randn(HIDDEN, generator=gen)
    col, row = ColumnParallelLinear(HIDDEN, INTER), RowParallelLinear(INTER, HIDDEN, bias=True)
    load_param(col.weight, w_up, None, "up.weight")
    load_param(row.weight, w_down, None, "down.weight")
    load_param(row.bias, b_down, None, "down.bias")
    _close(row(col(x)), F.linear(F.linear(x, w_up), w_down, b_down))
    assert col.weight.numel() == w_up.numel() // 2 and row.weight.numel() == w_down.numel() // 2

    # gate/up merged: this rank's half of each shard, side by side.
    w_gate = torch.randn(INTER, HIDDEN, generator=gen)
    merged = MergedColumnParallelLinear(HIDDEN, {"gate": INTER, "up": INTER})
    load_param(merged.weight, w_gate, "gate", "gate_proj.weight")
    load_param(merged.weight, w_up, "up", "up_proj.weight")
    half = slice(rank * INTER // 2, (rank + 1) * INTER // 2)
    _close(merged(x), torch.cat([F.linear(x, w_gate)[:, half], F.linear(x, w_up)[:, half]], 1))

    # q/k/v by heads: KV heads split (4 q, 2 kv) and replicated (4 q, 1 kv).
    for heads, kv_heads in ((4, 2), (4, 1)):
        wq = torch.randn(heads * HEAD_DIM, HIDDEN, generator=gen)
        wk, wv = (torch.randn(kv_heads * HEAD_DIM, HIDDEN, generator=gen) for _ in range(2))
        qkv = QKVParallelLinear(HIDDEN, heads, kv_heads, HEAD_DIM)
        for shard, w in (("q", wq), ("k", wk), ("v", wv)):
            load_param(qkv.weight, w, shard, f"{shard}_proj.weight")
        q_rows = slice(rank * 2 * HEAD_DIM, (rank + 1) * 2 * HEAD_DIM)
        kv_head = rank * kv_heads // 2
        kv_rows = slice(kv_head * HEAD_DIM, (kv_head + 1) * HEAD_DIM)
        want = torch.cat(
            [F.linear(x, wq[q_rows]), F.linear(x, wk[kv_rows]), F.linear(x, wv[kv_rows])], 1
        )
        _close(qkv(x), want)

    # The vocabulary split 51 + 50 (the last rank's padding row never looked up).
    table = torch.randn(VOCAB, HIDDEN, generator=gen)
    ids = torch.tensor([0, 50, 51, 100, 7, 99])
    embed, head = VocabParallelEmbedding(VOCAB, HIDDEN), ParallelLMHead(VOCAB, HIDDEN)
    load_param(embed.weight, table, None, "embed_tokens.weight")
    load_param(head.weight, table, None, "lm_head.weight")
    _close(embed(ids), F.embedding(ids, table))
    _close(head.logits(x), F.linear(x, table))
    assert embed.weight.shape[0] == 51 and tp_rank() == rank


def test_two_ranks_give_the_unsharded_layers_outputs():
    mp.spawn(_rank_checks, args=(free_port(),), nprocs=2, join=True)


@torch.inference_mode()
def test_one_rank_is_the_plain_layer():
    """Without a process group the layers hold the whole weight, the plain layer's numbers."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, INTER, generator=gen), torch.randn(HIDDEN, INTER, generator=gen)
    row = RowParallelLinear(INTER, HIDDEN)
    load_param(row.weight, w, None, "down.weight")
    assert isinstance(row, nn.Linear) and row.weight.shape == w.shape
    assert torch.equal(row(x), F.linear(x, w))
    table, ids = torch.randn(VOCAB, HIDDEN, generator=gen), torch.tensor([0, 100, 3])
    embed = VocabParallelEmbedding(VOCAB, HIDDEN)
    load_param(embed.weight, table, None, "embed_tokens.weight")
    assert torch.equal(embed(ids), F.embedding(ids, table))


def test_a_checkpoint_of_another_shape_is_refused_naming_it():
    col = ColumnParallelLinear(HIDDEN, INTER)
    try:
        load_param(col.weight, torch.zeros(INTER + 1, HIDDEN), None, "up.weight")
    except ValueError as exc:
        assert "'up.weight'" in str(exc) and str((INTER, HIDDEN)) in str(exc)
    else:
        raise AssertionError("a wrong shape was loaded")


def _refuse_to_unpickle():
    raise RuntimeError("this rank dies before it joins")


class _DiesOnArrival:
    """A config whose copy in the spawned rank cannot be rebuilt: the rank exits at start."""

    device = "cpu"

    def __reduce__(self):
        return _refuse_to_unpickle, ()


def test_a_rank_that_dies_before_joining_is_named_at_once():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="tensor-parallel rank 1 exited"):
        RankGroup.start(_DiesOnArrival(), 2)
    assert time.monotonic() - start < 60  # not the 600 s rendezvous timeout
