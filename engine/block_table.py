"""The block tables of the running requests in one layer group, kept as one int32 tensor
between steps."""

from __future__ import annotations

import torch

from engine.scheduler import ScheduledRequest


class BlockTable:
    """One row per request scheduled in the last step; rows change only where blocks were added.

    A request keeps its row while it is scheduled step after step; its blocks then only grow
    (a request loses blocks only by preemption or finishing, and is not scheduled in that step;
    a window's blocks give way to the null block, but the kernels never read blocks before a
    window, so the old ids may stay), so only the new block ids are written. A request that was
    not scheduled in a step gives its row back; when it returns its whole block list is written
    again. The tensor grows (doubling) when more rows or columns are needed.
    """

    def __init__(self, group: int = 0, num_rows: int = 64, num_cols: int = 64) -> None:
        self.group = group
        self.table = torch.full((num_rows, num_cols), -1, dtype=torch.int32)
        self.free_rows = list(range(num_rows - 1, -1, -1))
        # request_id -> [row, num_blocks written, the Request]: an id may be reused at once by a
        # new request after the old one finished, so the entry also checks the object.
        self.entries: dict[str, list] = {}

    def update(self, scheduled: list[ScheduledRequest]) -> tuple[list[int], int]:
        """Sync rows with the step's block ids; returns each request's row and the widest row."""
        previous, current = self.entries, {}
        rows, max_blocks = [], 1
        upd_rows, upd_cols, upd_ids = [], [], []
        for s in scheduled:
            rid, block_ids = s.request.request_id, s.block_ids[self.group]
            entry = previous.pop(rid, None)
            if entry is not None and entry[2] is not s.request:
                previous[f"{rid}\0stale"] = entry  # freed below, with the unscheduled ones
                entry = None
            if entry is None:
                entry = [self._take_row(), 0, s.request]
            row, written, _ = entry
            num_blocks = len(block_ids)
            assert num_blocks >= written, (rid, num_blocks, written)
            if num_blocks > written:
                upd_rows.extend([row] * (num_blocks - written))
                upd_cols.extend(range(written, num_blocks))
                upd_ids.extend(block_ids[written:])
                entry[1] = num_blocks
            current[rid] = entry
            rows.append(row)
            max_blocks = max(max_blocks, num_blocks)
        if previous:
            freed = [entry[0] for entry in previous.values()]
            self.table[torch.tensor(freed)] = -1
            self.free_rows.extend(freed)
        self.entries = current
        if max_blocks > self.table.shape[1]:
            self._grow(cols=max(max_blocks, 2 * self.table.shape[1]))
        if upd_rows:
            self.table[torch.tensor(upd_rows), torch.tensor(upd_cols)] = torch.tensor(
                upd_ids, dtype=torch.int32
            )
        return rows, max_blocks

    def _take_row(self) -> int:
        if not self.free_rows:
            self._grow(rows=2 * self.table.shape[0])
        return self.free_rows.pop()

    def _grow(self, rows: int | None = None, cols: int | None = None) -> None:
        old_rows, old_cols = self.table.shape
        rows, cols = rows or old_rows, cols or old_cols
        table = torch.full((rows, cols), -1, dtype=torch.int32)
        table[:old_rows, :old_cols] = self.table
        self.table = table
        self.free_rows.extend(range(rows - 1, old_rows - 1, -1))
