"""The ranks of one tensor-parallel engine: rank 0 (the process that made the ``LLMEngine``:
scheduler, KV block manager, sampler, Redis) starts the others, each an ``LLMEngine`` of its own
shard that follows rank 0's step plans (``follow``), and watches them.

A rank that exits makes rank 0 raise ``RankFailure`` at its next step or health check, and a
rank that hangs makes its next collective time out (engine/parallel/state.py): either way a
worker exits, and its jobs run again elsewhere (the lease fence). When rank 0 dies, the others'
next receive fails and they exit; a watcher thread also ends them if their parent is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.parallel.state import destroy_tensor_parallel, init_tensor_parallel

log = logging.getLogger("pagedq.parallel")
JOIN_TIMEOUT_S = 30.0


class RankFailure(RuntimeError):
    """A tensor-parallel rank exited, hung or failed: the engine cannot step any more. Never a
    request's fault, so step isolation does not look for a culprit."""


def check_rank_count(tensor_parallel_size: int, device: torch.device) -> None:
    """Refuse more ranks than devices (CUDA GPUs, or CPUs on a CPU host), naming both."""
    if device.type == "cuda":
        count, what = torch.cuda.device_count(), "CUDA devices"
    else:
        count, what = len(os.sched_getaffinity(0)), "CPUs this process may use"
    # Under torchrun over several hosts, only this host's ranks need this host's devices.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", tensor_parallel_size))
    if local > count:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} is more than the {count} {what}: "
            f"one rank per device"
        )


def rank_device(device: torch.device, rank: int) -> str:
    """Rank ``rank``'s device: ``cuda:<its index on this host>`` on CUDA, the CPU otherwise."""
    local = int(os.environ.get("LOCAL_RANK", rank))
    return f"cuda:{local}" if device.type == "cuda" else "cpu"


def _backend(config) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if str(config.device).startswith("cuda") else "gloo"


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (rank 0's store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankGroup:
    """Rank 0's handle on the other ranks' processes."""

    def __init__(self, processes: list) -> None:
        self.processes = processes  # rank r is processes[r - 1]
        self.closed = False

    @classmethod
    def start(cls, config, tensor_parallel_size: int, timeout_s: float | None = None):
        """Spawn ranks 1..N-1 with ``config`` (its "auto" values resolved) and join the group
        as rank 0. Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) the launcher has started
        every rank: this one joins with the environment's rendezvous and starts nothing."""
        if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
            world = int(os.environ["WORLD_SIZE"])
            if world != tensor_parallel_size:
                raise ValueError(
                    f"tensor_parallel_size={tensor_parallel_size} differs from the launcher's "
                    f"WORLD_SIZE={world}"
                )
            init_tensor_parallel(
                int(os.environ["RANK"]), world, "env://", _backend(config), timeout_s
            )
            return cls([])
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        processes = []
        for rank in range(1, tensor_parallel_size):
            p = ctx.Process(
                target=run_follower,
                args=(rank, tensor_parallel_size, init_method, config, os.getpid()),
                name=f"pagedq-rank{rank}",
                daemon=True,
            )
            p.start()
            processes.append(p)
        group = cls(processes)
        try:
            init_tensor_parallel(
                0, tensor_parallel_size, init_method, _backend(config), timeout_s, group.check
            )
        except Exception:
            group.kill()
            raise
        return group

    def check(self, channel=None) -> None:
        """Raise ``RankFailure`` if another rank's process has exited, or if the plan
        channel's keepalive found one that no longer answers."""
        for rank, p in enumerate(self.processes, start=1):
            if p.exitcode is not None:
                message = f"tensor-parallel rank {rank} exited (code {p.exitcode})"
                log.error("%s: the engine stops", message)
                raise RankFailure(message)
        if channel is not None and channel.error is not None:
            message = f"a tensor-parallel rank stopped answering: {channel.error}"
            log.error("%s: the engine stops", message)
            raise RankFailure(message)

    def shutdown(self, channel) -> None:
        """Stop the other ranks (a STOP plan), wait for them, and leave the group."""
        if self.closed:
            return
        self.closed = True
        alive = all(p.exitcode is None for p in self.processes)
        if channel is not None:
            channel.close()
        if alive and channel is not None:
            try:
                channel.stop()
            except Exception:  # noqa: BLE001 - a rank died meanwhile: killed below
                alive = False
        if dist.is_initialized():
            if alive:  # the others leave too: one barrier, then each destroys its group
                try:
                    destroy_tensor_parallel()
                except Exception:  # noqa: BLE001 - a rank died at the barrier
                    dist.destroy_process_group()
            else:  # no barrier with ranks that are gone
                dist.destroy_process_group()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """End every other rank's process now."""
        for p in self.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


def _exit_with_parent(parent_pid: int) -> None:
    """End this rank when rank 0's process is gone (its sockets may not say so at once)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def run_follower(rank: int, world_size: int, init_method: str, config, parent_pid: int) -> None:
    """A rank other than 0: join the group, build this rank's shard of the engine, and run
    rank 0's step plans until it stops."""
    from engine.llm_engine import LLMEngine

    logging.basicConfig(level=logging.INFO, format=f"rank{rank} %(levelname)s %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    try:
        init_tensor_parallel(rank, world_size, init_method, _backend(config))
        config = dataclasses.replace(config, device=rank_device(torch.device(config.device), rank))
        engine = LLMEngine(config)
        engine.follow()
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)
    destroy_tensor_parallel()
