"""Step inputs, built incrementally and vectorized, equal their plain definition."""

from __future__ import annotations

import torch

from engine.block_table import BlockTable
from engine.model_runner import ModelRunner
from engine.models.rotary import RotaryEmbedding
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, SchedulerOutput

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=8)


class _NoModel:
    def prepack(self) -> bool:
        return False


def runner() -> ModelRunner:
    return ModelRunner(_NoModel(), [], BLOCK, torch.device("cpu"), None, set())


def expected_slots(start: int, end: int, block_ids: list[int]) -> list[int]:
    return [block_ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]


def test_mixed_prefill_chunks_and_decodes():
    r = runner()
    a, b = Request("a", list(range(10)), GREEDY), Request("b", [7, 8, 9], GREEDY)
    step = SchedulerOutput([ScheduledRequest(a, 6, [[5, 9]]), ScheduledRequest(b, 3, [[2]])])
    inputs = r.prepare_inputs(step)
    ids, pos, (meta,) = inputs.input_ids, inputs.positions, inputs.metadata()
    logits_indices, rows = inputs.logits_indices, inputs.sample_rows
    assert ids.tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 9]
    assert pos.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert meta.slot_mapping.tolist() == expected_slots(0, 6, [5, 9]) + expected_slots(0, 3, [2])
    assert meta.query_start_loc.tolist() == [0, 6, 9]
    assert meta.seq_lens.tolist() == [6, 3]
    assert meta.block_table.tolist() == [[5, 9], [2, -1]]
    assert logits_indices.tolist() == [8] and rows == [1]  # a's prompt is not complete yet

    a.num_computed_tokens, b.num_computed_tokens = 6, 3
    b.append_output_token(11)
    step = SchedulerOutput([ScheduledRequest(a, 4, [[5, 9, 3]]), ScheduledRequest(b, 1, [[2]])])
    inputs = r.prepare_inputs(step)
    ids, pos, (meta,) = inputs.input_ids, inputs.positions, inputs.metadata()
    logits_indices, rows = inputs.logits_indices, inputs.sample_rows
    assert ids.tolist() == [6, 7, 8, 9, 11]
    assert meta.slot_mapping.tolist() == expected_slots(6, 10, [5, 9, 3]) + [2 * BLOCK + 3]
    assert meta.block_table.tolist() == [[5, 9, 3], [2, -1, -1]]
    assert logits_indices.tolist() == [3, 4] and rows == [0, 1]


def test_unscheduled_request_gives_its_row_back_and_a_reused_id_gets_a_fresh_row():
    table = BlockTable(num_rows=2, num_cols=2)
    old = Request("x", [1, 2, 3], GREEDY)
    table.update([ScheduledRequest(old, 3, [[4, 5, 6]])])  # grows to 4 columns
    new = Request("x", [9], GREEDY)  # same id, a different request, the very next step
    rows, width = table.update([ScheduledRequest(new, 1, [[7]])])
    assert width == 1
    assert table.table[rows[0]].tolist()[:3] == [7, -1, -1]
    assert (table.table == -1).sum() == table.table.numel() - 1  # the old row was reset


def test_rows_grow_past_the_initial_table():
    table = BlockTable(num_rows=2, num_cols=2)
    reqs = [Request(str(i), [1], GREEDY) for i in range(5)]
    rows, width = table.update(
        [ScheduledRequest(q, 1, [list(range(10 * i, 10 * i + i + 1))]) for i, q in enumerate(reqs)]
    )
    assert width == 5 and len(set(rows)) == 5
    for i, row in enumerate(rows):
        assert table.table[row, : i + 1].tolist() == list(range(10 * i, 10 * i + i + 1))
        assert table.table[row, i + 1 :].eq(-1).all()


def test_rotary_once_per_step_equals_the_reference_bit_for_bit():
    from transformers import LlamaConfig

    from kernels import apply_rotary

    rotary = RotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=2), 32, 128)
    positions = torch.tensor([0, 5, 17, 127, 3])
    q, k = torch.randn(5, 2, 32), torch.randn(5, 1, 32)
    want_q, want_k = rotary(positions, q, k)
    qk = torch.cat((q, k), dim=1)
    got = apply_rotary(qk, *rotary.cos_sin(positions, qk.dtype))  # the model's call
    assert torch.equal(got[:, :2], want_q) and torch.equal(got[:, 2:], want_k)
