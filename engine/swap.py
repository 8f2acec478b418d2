"""Swap preemption: a host-memory pool for KV blocks, and the cost rule swap vs recompute."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.parallel.cache_ops import KV_FROM_HOST, KV_TO_HOST

# Before any prefill has been timed: a conservative guess per device type (tokens/s).
INITIAL_PREFILL_TOKENS_PER_S = {"cpu": 500.0, "cuda": 20_000.0}
PREFILL_EMA_ALPHA = 0.2
BANDWIDTH_PROBE_BYTES = 8 * 2**20


@dataclass(slots=True)
class PreemptionCostModel:
    """Estimates what each kind of preemption costs, in seconds, and picks the cheaper one."""

    copy_bytes_per_s: float
    prefill_tokens_per_s: float = INITIAL_PREFILL_TOKENS_PER_S["cpu"]

    def swap_seconds(self, num_bytes: int) -> float:
        """Copy out now and back in later."""
        return 2 * num_bytes / self.copy_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        """Prefill the computed tokens again."""
        return num_tokens / self.prefill_tokens_per_s

    def choose(self, num_bytes: int, num_tokens: int) -> str:
        """ "swap" when copying ``num_bytes`` both ways is cheaper than recomputing, else
        "recompute"."""
        if self.swap_seconds(num_bytes) < self.recompute_seconds(num_tokens):
            return "swap"
        return "recompute"

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """Fold one timed step that prefilled into the moving average of prefill speed."""
        if num_tokens <= 0 or seconds <= 0:
            return
        speed = num_tokens / seconds
        a = PREFILL_EMA_ALPHA
        self.prefill_tokens_per_s = (1 - a) * self.prefill_tokens_per_s + a * speed


class SwapSpace:
    """Host tensors shaped like the device KV caches, with their own block ids.

    A swapped-out request owns host blocks only; its device blocks go back to the block pool.
    Swap-in copies into whatever device blocks the request is allocated then.

    ``block_dims``: each tensor's block axis (1 for ``[2, num_blocks, ...]`` K/V, the default;
    0 for a latent cache ``[num_blocks, ...]``).
    """

    def __init__(
        self, kv_caches: list[torch.Tensor], num_blocks: int, block_dims: list[int] | None = None
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"swap space of {num_blocks} blocks is invalid: must be >= 1")
        self.kv_caches = kv_caches
        self.num_blocks = num_blocks
        self.block_dims = block_dims or [1] * len(kv_caches)
        pin = kv_caches[0].device.type == "cuda"
        # torch.empty: host pages are only committed once a block is actually swapped out.
        # Each host cache is shaped like its own layer's (head sizes may differ per layer).
        self.host_caches = [
            torch.empty(_resized(c, d, num_blocks), dtype=c.dtype, device="cpu", pin_memory=pin)
            for c, d in zip(kv_caches, self.block_dims, strict=True)
        ]
        self.bytes_per_block = bytes_per_block(kv_caches, self.block_dims)
        # Free host blocks: those given back (a stack) and the never used ones from
        # ``_fresh`` on, not a list of every id: a model without attention has 64-byte blocks,
        # and a list of a 4 GiB pool's 67 M ids took 2.6 GB.
        self._returned: list[int] = []
        self._fresh = 0
        self.req_to_host_blocks: dict[str, list[int]] = {}
        self.state_cache = None  # a StateCache whose slots move with the blocks, or None
        self.op_log = None  # a CacheOpLog where other tensor-parallel ranks follow these copies

    @classmethod
    def from_budget(
        cls, kv_caches: list[torch.Tensor], num_bytes: int, block_dims: list[int] | None = None
    ) -> SwapSpace | None:
        """A pool of ``num_bytes`` (None when that is less than one block)."""
        num_blocks = num_bytes // bytes_per_block(kv_caches, block_dims)
        return cls(kv_caches, num_blocks, block_dims) if num_blocks >= 1 else None

    @property
    def num_free_blocks(self) -> int:
        """Host blocks not holding a swapped request."""
        return len(self._returned) + self.num_blocks - self._fresh

    @property
    def num_swapped_requests(self) -> int:
        """Requests whose KV is in the pool now."""
        return len(self.req_to_host_blocks)

    def _take(self) -> int:
        """A free host block: the last given back, else the next never used."""
        if self._returned:
            return self._returned.pop()
        self._fresh += 1
        return self._fresh - 1

    def swap_out(self, request_id: str, block_ids: list[int]) -> int:
        """Copy these device blocks into free host blocks; returns the bytes copied."""
        free = self.num_free_blocks
        if len(block_ids) > free:
            raise ValueError(f"cannot swap out {len(block_ids)} blocks: {free} free")
        host_ids = [self._take() for _ in block_ids]
        self.req_to_host_blocks[request_id] = host_ids
        self.copy_to_host(block_ids, host_ids)
        state_bytes = self.state_cache.swap_out(request_id) if self.state_cache else 0
        return len(block_ids) * self.bytes_per_block + state_bytes

    def swap_in(self, request_id: str, block_ids: list[int]) -> int:
        """Copy a request's host blocks into these device blocks and free the host blocks."""
        host_ids = self.req_to_host_blocks[request_id]
        assert len(block_ids) == len(host_ids), (block_ids, host_ids)
        self.copy_from_host(host_ids, block_ids)
        state_bytes = self.state_cache.swap_in(request_id) if self.state_cache else 0
        self.free(request_id)
        return len(block_ids) * self.bytes_per_block + state_bytes

    def free(self, request_id: str) -> None:
        """Drop a request's host blocks (swap-in done, or the request was aborted)."""
        self._returned.extend(reversed(self.req_to_host_blocks.pop(request_id, [])))
        if self.state_cache is not None:
            self.state_cache.drop_swapped(request_id)

    def copy_to_host(self, block_ids: list[int], host_ids: list[int]) -> None:
        """Copy device blocks into host blocks (no bookkeeping)."""
        if self.op_log is not None:
            self.op_log.record(KV_TO_HOST, *block_ids, *host_ids)
        self._copy(self.kv_caches, block_ids, self.host_caches, host_ids)

    def copy_from_host(self, host_ids: list[int], block_ids: list[int]) -> None:
        """Copy host blocks into device blocks (no bookkeeping)."""
        if self.op_log is not None:
            self.op_log.record(KV_FROM_HOST, *host_ids, *block_ids)
        self._copy(self.host_caches, host_ids, self.kv_caches, block_ids)

    def _copy(self, src: list[torch.Tensor], src_ids, dst: list[torch.Tensor], dst_ids) -> None:
        if not src_ids:
            return
        s = torch.tensor(src_ids, dtype=torch.long, device=src[0].device)
        d = torch.tensor(dst_ids, dtype=torch.long, device=dst[0].device)
        for src_layer, dst_layer, dim in zip(src, dst, self.block_dims, strict=True):
            # Indexing, not index_select + index_copy_: on the CPU cache's head-major view that
            # pair took 71 ms against 6.4 ms for 256 blocks of a SmolLM2 layer (swap-out).
            rows = src_layer[_along(dim, s)].to(dst_layer.device, non_blocking=False)
            dst_layer[_along(dim, d)] = rows

    def measure_copy_bandwidth(self) -> float:
        """Bytes per second of one device -> host copy of 8 MiB (best of three)."""
        return measure_copy_bandwidth(self.kv_caches[0].device, self.host_caches[0].is_pinned())


def measure_copy_bandwidth(device: torch.device, pin: bool = False) -> float:
    """Bytes per second of a device -> host copy of ``BANDWIDTH_PROBE_BYTES`` (best of three).

    A scratch buffer of a fixed size, so that the figure is a bandwidth and not the fixed cost
    of one small copy.
    """
    src = torch.ones(BANDWIDTH_PROBE_BYTES // 4, dtype=torch.float32, device=device)
    dst = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
    best = float("inf")
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return BANDWIDTH_PROBE_BYTES / max(best, 1e-9)


def bytes_per_block(kv_caches: list[torch.Tensor], block_dims: list[int] | None = None) -> int:
    """Bytes of one block across every tensor (K and V, or a latent row per token)."""
    dims = block_dims or [1] * len(kv_caches)
    return sum(c.numel() // c.shape[d] * c.element_size() for c, d in zip(kv_caches, dims))


def _along(dim: int, ids: torch.Tensor) -> tuple:
    return (slice(None),) * dim + (ids,)


def _resized(cache: torch.Tensor, block_dim: int, num_blocks: int) -> tuple[int, ...]:
    shape = list(cache.shape)
    shape[block_dim] = num_blocks
    return tuple(shape)
