"""The tensor-parallel group: which rank this process is, how many there are, and the three
collectives the sharded layers use. With no group (one rank) every call is a no-op, so a layer
written for N ranks runs unchanged at N = 1."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

# A collective waits this long for a rank that died or hung, then raises: the worker exits.
# PAGEDQ_COLLECTIVE_TIMEOUT_S overrides it (a model whose first step compiles kernels for
# minutes on every rank needs more; tests of a hung rank need less).
DEFAULT_TIMEOUT_S = 60.0
TIMEOUT_ENV = "PAGEDQ_COLLECTIVE_TIMEOUT_S"
RENDEZVOUS_TIMEOUT_S = 600.0  # the ranks' first meeting: each loads torch and the model first


def collective_timeout_s() -> float:
    """Seconds a collective waits: ``$PAGEDQ_COLLECTIVE_TIMEOUT_S``, else 60."""
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


# How MoE layers split past one rank: "ep" (whole experts spread over the ranks) or "tp"
# (every expert's intermediate features split, like a dense MLP).
MOE_PARALLEL_MODES = ("ep", "tp")
_moe_parallel = "ep"


def set_moe_parallel(mode: str) -> None:
    """Choose how MoE layers built from now on split ("ep" or "tp")."""
    global _moe_parallel
    if mode not in MOE_PARALLEL_MODES:
        raise ValueError(f"moe_parallel={mode!r} is invalid: must be one of {MOE_PARALLEL_MODES}")
    _moe_parallel = mode


def moe_parallel() -> str:
    """ "ep" or "tp": how MoE layers split over the ranks (meaningless at one rank)."""
    return _moe_parallel


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str, backend: str | None = None,
    timeout_s: float | None = None, check_ranks: Callable[[], None] | None = None,
) -> None:  # fmt: skip
    """Join the group of ``world_size`` ranks as ``rank`` (gloo on the CPU, NCCL on CUDA).
    ``check_ranks``: called by rank 0 while it waits for the others at a ``tcp://``
    rendezvous; it raises when one of them has exited, so a rank that dies before it joins is
    named at once rather than after the rendezvous timeout."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, tensor_parallel_size={world_size})")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(seconds=timeout_s or collective_timeout_s())
    if init_method.startswith("tcp://"):
        # The ranks meet through rank 0's store, which waits for slow starters (imports on a
        # busy host) longer than a collective waits for a hung rank.
        host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
        store = dist.TCPStore(
            host, int(port), world_size, is_master=rank == 0,
            timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S), wait_for_workers=False,
        )  # fmt: skip
        if rank > 0:
            store.add(_JOINED, 1)
        else:
            _wait_for_ranks(store, world_size, check_ranks)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        return
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
    )


_JOINED = "pagedq/ranks_joined"


def _wait_for_ranks(store, world_size: int, check_ranks: Callable[[], None] | None) -> None:
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
    while (joined := store.add(_JOINED, 0)) < world_size - 1:
        if check_ranks is not None:
            check_ranks()
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{joined} of the {world_size - 1} other tensor-parallel ranks joined within "
                f"{RENDEZVOUS_TIMEOUT_S:.0f} s"
            )
        time.sleep(0.05)


def destroy_tensor_parallel() -> None:
    """Leave the group (after a barrier): a process that exits with gloo's threads still
    running aborts ("terminate called without an active exception")."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def tp_rank() -> int:
    """This process's rank in the group (0 without one)."""
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    """The number of ranks (1 without a group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the ranks, in place; ``x`` itself at one rank."""
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` side by side along the last dim, in rank order."""
    if tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's ``value`` (e.g. the KV budget each device can give)."""
    if tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator``, refused naming ``what`` when it does not divide."""
    if numerator % denominator:
        raise ValueError(
            f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}"
        )
    return numerator // denominator
