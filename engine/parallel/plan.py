"""The step plan: what rank 0 sends every other rank before each step (nano-vllm's and vLLM's
"driver broadcasts, workers follow").

A plan is the step's ``StepInputs`` (token ids, positions, block tables, slot mappings, state
slots, the rows to sample) and the cache copies rank 0 did since the last plan (swap, state
snapshots: engine/parallel/cache_ops.py), all integers: packed into one int64 tensor and sent
with two broadcasts on a gloo group of its own (its size, then the tensor). Nothing is
pickled.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.parallel.state import collective_timeout_s
from engine.step_inputs import StepInputs

# Plan kinds (the first header word).
STEP, STOP, KEEPALIVE = 1, 2, 3
KEEPALIVE_S = 10.0
_DTYPES = [torch.int64, torch.int32, torch.bool, torch.int16, torch.uint8]
_LOGITS_NONE, _LOGITS_ALL, _LOGITS_ROWS = 0, 1, 2
_FIXED = ("input_ids", "positions", "query_start_loc", "seq_lens", "num_prompt_tokens",
          "state_indices", "has_initial_state")  # fmt: skip


def pack_plan(inputs: StepInputs, cache_ops: list[int]) -> torch.Tensor:
    """``inputs`` (on the CPU) and the cache copies as one int64 tensor."""
    logits = inputs.logits_indices
    if logits is None:
        mode, rows = _LOGITS_NONE, None
    elif isinstance(logits, slice):
        mode, rows = _LOGITS_ALL, None
    else:
        mode, rows = _LOGITS_ROWS, logits
    tensors = [getattr(inputs, name) for name in _FIXED]
    tensors += [rows, torch.tensor(cache_ops, dtype=torch.int64)]
    for slots, table in zip(inputs.slot_mappings, inputs.block_tables, strict=True):
        tensors += [slots, table]
    header = [mode, len(tensors)]
    for t in tensors:
        if t is None:
            header += [0, 0, 0, 0]
        else:
            shape = (*t.shape, 1) if t.dim() == 1 else tuple(t.shape)
            header += [1 + t.dim(), _DTYPES.index(t.dtype), *shape]
    parts = [torch.tensor(header, dtype=torch.int64)]
    parts += [t.reshape(-1).to(torch.int64) for t in tensors if t is not None]
    return torch.cat(parts)


def unpack_plan(packed: torch.Tensor) -> tuple[StepInputs, list[int]]:
    """The inverse of ``pack_plan``."""
    mode, count = packed[:2].tolist()
    header = packed[2 : 2 + 4 * count].view(count, 4).tolist()
    offset, tensors = 2 + 4 * count, []
    for present, dtype, d0, d1 in header:
        if not present:
            tensors.append(None)
            continue
        t = packed[offset : offset + d0 * d1].to(_DTYPES[dtype])
        tensors.append(t.view(d0, d1) if present == 3 else t)
        offset += d0 * d1
    fixed = dict(zip(_FIXED, tensors))
    rows, ops, groups = tensors[len(_FIXED)], tensors[len(_FIXED) + 1], tensors[len(_FIXED) + 2 :]
    logits = {_LOGITS_NONE: None, _LOGITS_ALL: slice(None), _LOGITS_ROWS: rows}[mode]
    inputs = StepInputs(
        **fixed, slot_mappings=groups[0::2], block_tables=groups[1::2], logits_indices=logits
    )
    return inputs, ops.tolist()


class PlanChannel:
    """Rank 0 sends plans; every other rank receives them, in order.

    Its gloo group has the collectives' timeout, so a rank that hangs is noticed on either
    side; an idle rank 0 sends a KEEPALIVE plan every ``keepalive_s`` from a thread of its own,
    so that waiting for work is never mistaken for a hang.
    """

    def __init__(self, keepalive_s: float = KEEPALIVE_S) -> None:
        self.group = dist.new_group(
            backend="gloo", timeout=timedelta(seconds=collective_timeout_s())
        )
        self.keepalive_s = keepalive_s
        self.error: BaseException | None = None  # the keepalive thread's failure, if any
        self._lock = threading.Lock()
        self._last_sent = time.monotonic()
        self._stopped = threading.Event()
        if dist.get_rank() == 0:
            threading.Thread(target=self._keepalive, name="plan-keepalive", daemon=True).start()

    def send(self, inputs: StepInputs, cache_ops: list[int]) -> None:
        """Rank 0: the next step's plan."""
        packed = pack_plan(inputs, cache_ops)
        self._send(STEP, packed)

    def stop(self) -> None:
        """Rank 0: no more steps; the other ranks leave their loop."""
        self.close()
        self._send(STOP, None)

    def close(self) -> None:
        """Rank 0: end the keepalives, and wait out one in flight (before the group goes:
        a broadcast on a destroyed group aborts the process)."""
        self._stopped.set()
        with self._lock:
            pass

    def recv(self) -> tuple[StepInputs, list[int]] | None:
        """Another rank: the next plan, or None once rank 0 stopped."""
        while True:
            header = torch.empty(2, dtype=torch.int64)
            dist.broadcast(header, 0, group=self.group)
            kind, size = header.tolist()
            if kind == STOP:
                return None
            if kind == STEP:
                packed = torch.empty(size, dtype=torch.int64)
                dist.broadcast(packed, 0, group=self.group)
                return unpack_plan(packed)

    def _send(self, kind: int, packed: torch.Tensor | None) -> None:
        with self._lock:
            size = 0 if packed is None else packed.numel()
            dist.broadcast(torch.tensor([kind, size]), 0, group=self.group)
            if packed is not None:
                dist.broadcast(packed, 0, group=self.group)
            self._last_sent = time.monotonic()

    def _keepalive(self) -> None:
        while not self._stopped.wait(self.keepalive_s / 4):
            if time.monotonic() - self._last_sent < self.keepalive_s:
                continue
            try:
                self._send(KEEPALIVE, None)
            except Exception as exc:  # noqa: BLE001 - rank 0's next health check raises it
                self.error = exc
                return
