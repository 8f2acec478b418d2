"""Cache copies outside the model: what rank 0 did to its KV and state tensors between two
steps (swap out and in, recurrent-state snapshots), logged as integers so every other rank
does the same to its own shard before the next step.

Each op is ``[code, n, *ids]``: the block ids or slot numbers it moves, so the other ranks need
none of rank 0's bookkeeping (which request holds what), only the same copies in the same
order.
"""

from __future__ import annotations

KV_TO_HOST, KV_FROM_HOST = 1, 2  # ids: device blocks then host blocks / host then device
STATE_TO_HOST, STATE_FROM_HOST, STATE_COPY, STATE_DROP = 3, 4, 5, 6  # (slot, key) ...


class CacheOpLog:
    """The copies since the last plan (rank 0 only; None at one rank)."""

    def __init__(self) -> None:
        self.ops: list[int] = []

    def record(self, code: int, *ids: int) -> None:
        """Log one copy."""
        self.ops += [code, len(ids), *ids]

    def take(self) -> list[int]:
        """The copies logged so far, and a fresh log."""
        ops, self.ops = self.ops, []
        return ops


def replay(ops: list[int], swap_space, state_cache) -> None:
    """Do rank 0's copies on this rank's KV and state tensors, in order."""
    i = 0
    while i < len(ops):
        code, n = ops[i], ops[i + 1]
        ids = ops[i + 2 : i + 2 + n]
        i += 2 + n
        if code == KV_TO_HOST:
            swap_space.copy_to_host(ids[: n // 2], ids[n // 2 :])
        elif code == KV_FROM_HOST:
            swap_space.copy_from_host(ids[: n // 2], ids[n // 2 :])
        elif code == STATE_TO_HOST:
            state_cache.copy_to_host(*ids)
        elif code == STATE_FROM_HOST:
            state_cache.copy_from_host(*ids)
        elif code == STATE_COPY:
            state_cache.copy_slot(*ids)
        elif code == STATE_DROP:
            state_cache.drop_host(*ids)
        else:
            raise ValueError(f"unknown cache op {code}")
