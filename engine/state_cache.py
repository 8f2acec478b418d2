"""The recurrent-state layer group: layers that keep no KV per token but one fixed-size state per
sequence (Gated DeltaNet's convolution window and fp32 recurrent state, Qwen3.5 / Qwen3-Next).

A pool of state slots beside the paged KV blocks, as vLLM's hybrid manager keeps a Mamba group:
a running request holds one slot (every linear layer's state at that index) from its first
scheduled token until it finishes or is preempted; admission needs a free slot as well as free
blocks. What a slot costs is flat in the context length. Preemption by recompute drops the
state; swap copies it to host memory and back into whatever slot the request gets on return.

Prefix caching keeps snapshots: extra slots holding the state at a block boundary, keyed by that
block's hash (the hash chains over every token before it), least recently used evicted first.
A hit on a hybrid model is allowed only where a snapshot is kept (engine/kv_cache_manager.py);
a snapshot whose blocks were evicted is never reached, as the hit stops at the blocks first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.parallel.cache_ops import (
    STATE_COPY,
    STATE_DROP,
    STATE_FROM_HOST,
    STATE_TO_HOST,
)


@dataclass(frozen=True, slots=True)
class RecurrentStateSpec:
    """One linear-attention layer's state per sequence: ``conv_shape`` ``(conv_dim,
    kernel_size - 1)`` in the model's dtype and ``state_shape`` ``(num_v_heads, k_dim, v_dim)``
    in fp32; ``(0, 0, 0)`` for a layer with a conv window only (LFM2's short convolution)."""

    conv_shape: tuple[int, int]
    state_shape: tuple[int, int, int]

    def nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of one sequence's state of this layer."""
        elem = torch.tensor([], dtype=dtype).element_size()
        conv = self.conv_shape[0] * self.conv_shape[1] * elem
        a, b, c = self.state_shape
        return conv + a * b * c * 4


def state_bytes_per_slot(specs: list[RecurrentStateSpec], dtype: torch.dtype) -> int:
    """Bytes of one slot: every linear layer's state of one sequence."""
    return sum(spec.nbytes(dtype) for spec in specs)


class StateCache:
    """``num_slots`` slots of every linear layer's state, and which request holds which."""

    def __init__(
        self,
        specs: list[RecurrentStateSpec],
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        num_snapshots: int = 0,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots} is invalid: must be >= 1")
        self.specs = specs
        self.num_slots, self.num_snapshots = num_slots, num_snapshots
        total = num_slots + num_snapshots
        self.conv_states = [
            torch.zeros(total, *s.conv_shape, dtype=dtype, device=device) for s in specs
        ]
        self.ssm_states = [
            torch.zeros(total, *s.state_shape, dtype=torch.float32, device=device) for s in specs
        ]
        self.free_snapshot_slots = list(range(total - 1, num_slots - 1, -1))
        self.snapshots: OrderedDict[object, int] = OrderedDict()  # block hash -> slot, LRU first
        self.bytes_per_slot = state_bytes_per_slot(specs, dtype)
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        self.req_to_slot: dict[str, int] = {}
        self.swapped: dict[str, int] = {}  # request id -> key of its host copy
        self.host: dict[int, list[torch.Tensor]] = {}  # key -> every layer's state, on the host
        self._next_key = 0
        self.op_log = None  # a CacheOpLog where other tensor-parallel ranks follow these copies

    @property
    def num_free_slots(self) -> int:
        """Slots no request holds."""
        return len(self.free_slots)

    @property
    def num_used_slots(self) -> int:
        """Slots held by running requests."""
        return len(self.req_to_slot)

    def has_room(self, request_id: str) -> bool:
        """True when ``request_id`` holds a slot or one is free."""
        return request_id in self.req_to_slot or bool(self.free_slots)

    def allocate(self, request_id: str) -> int:
        """The request's slot, taking a free one the first time (its state is then unread:
        the kernels start a sequence with nothing computed from zeros)."""
        slot = self.req_to_slot.get(request_id)
        if slot is None:
            slot = self.req_to_slot[request_id] = self.free_slots.pop()
        return slot

    def free(self, request_id: str) -> None:
        """Give the request's slot back (finished, aborted or preempted)."""
        slot = self.req_to_slot.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def slot(self, request_id: str) -> int:
        """The slot a scheduled request holds."""
        return self.req_to_slot[request_id]

    def swap_out(self, request_id: str) -> int:
        """Copy the request's state to host memory and free its slot; returns the bytes."""
        key = self.swapped[request_id] = self._next_key
        self._next_key += 1
        self.copy_to_host(self.req_to_slot[request_id], key)
        self.free(request_id)
        return self.bytes_per_slot

    def swap_in(self, request_id: str) -> int:
        """Copy a swapped request's state into the slot it holds now; returns the bytes."""
        self.copy_from_host(self.swapped.pop(request_id), self.req_to_slot[request_id])
        return self.bytes_per_slot

    def has_snapshot(self, key) -> bool:
        """True when the state after the block hashed ``key`` is kept."""
        return key in self.snapshots

    def save_snapshot(self, request_id: str, key) -> None:
        """Keep a copy of the request's state as the state after the block hashed ``key``."""
        if self.num_snapshots == 0 or key in self.snapshots:
            return
        if self.free_snapshot_slots:
            dst = self.free_snapshot_slots.pop()
        else:
            _, dst = self.snapshots.popitem(last=False)
        self.snapshots[key] = dst
        self.copy_slot(self.req_to_slot[request_id], dst)

    def restore(self, request_id: str, key) -> None:
        """Start the request's slot from the snapshot ``key`` (a prefix-cache hit)."""
        self.snapshots.move_to_end(key)
        self.copy_slot(self.snapshots[key], self.req_to_slot[request_id])

    def drop_swapped(self, request_id: str) -> None:
        """Forget a swapped request's host copy (aborted, or to be recomputed)."""
        key = self.swapped.pop(request_id, None)
        if key is not None:
            self.drop_host(key)

    # --- the copies themselves (no bookkeeping): what other tensor-parallel ranks replay ---
    def copy_to_host(self, slot: int, key: int) -> None:
        """Keep a host copy of ``slot``'s state under ``key``."""
        self._log(STATE_TO_HOST, slot, key)
        self.host[key] = [t[slot].to("cpu", copy=True) for t in self._pools()]

    def copy_from_host(self, key: int, slot: int) -> None:
        """Copy the host copy ``key`` into ``slot`` and drop it."""
        self._log(STATE_FROM_HOST, key, slot)
        for dst, src in zip(self._pools(), self.host.pop(key)):
            dst[slot].copy_(src)

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy one slot's state into another."""
        self._log(STATE_COPY, src, dst)
        for pool in self._pools():
            pool[dst].copy_(pool[src])

    def drop_host(self, key: int) -> None:
        """Forget the host copy ``key``."""
        self._log(STATE_DROP, key)
        self.host.pop(key, None)

    def _pools(self) -> tuple[torch.Tensor, ...]:
        return (*self.conv_states, *self.ssm_states)

    def _log(self, code: int, *ids: int) -> None:
        if self.op_log is not None:
            self.op_log.record(code, *ids)
