"""The plumbing of the recurrent-state kernels (``gated_delta``, ``kimi_delta``, ``mamba_ssm``,
``causal_conv1d``): a varlen batch whose sequence ``i`` owns rows ``query_start_loc[i]:
query_start_loc[i+1]`` and slot ``state_indices[i]`` of a state pool, starting from zero where
``has_initial_state[i]`` is False.

- ``compute_dtype``, ``initial_states``: the references' compute dtype and gathered states.
- ``scan_tokens``, ``scan_sequences``: the references' drivers, token by token over the whole
  batch (the recurrent forms) and sequence by sequence (the chunked forms); both write the final
  states back to the slots of sequences with at least one token.
- ``choose_backend``, ``cpu_takes``: the dispatchers' choice.
- ``cpu_slot_args``, ``fp32``: the argument preparation of the C++ ops' wrappers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any of ``tensors`` is (the references' oracle mode), else fp32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def initial_states(
    state_pool: torch.Tensor, slots: torch.Tensor, has_initial_state: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """The states of ``slots`` in ``dtype``, zero where ``has_initial_state`` is False."""
    states = state_pool[slots].to(dtype)
    if has_initial_state is not None:
        states = states * has_initial_state.to(states.device, torch.bool)[:, None, None, None]
    return states


def scan_tokens(
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], state_pool: torch.Tensor,
    query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None, dtype: torch.dtype,
) -> None:  # fmt: skip
    """The recurrent driver: at step ``t``, ``step(states, rows)`` advances the states of every
    sequence that has a ``t``-th token by the tokens at ``rows`` (writing their outputs) and
    returns the new states."""
    starts, ends = query_start_loc[:-1].long(), query_start_loc[1:].long()
    lens = ends - starts
    slots = state_indices.long()
    states = initial_states(state_pool, slots, has_initial_state, dtype)
    for t in range(int(lens.max()) if lens.numel() else 0):
        active = (lens > t).nonzero().flatten()
        states[active] = step(states[active], starts[active] + t)
    ran = lens > 0
    state_pool[slots[ran]] = states[ran].to(state_pool.dtype)


def scan_sequences(
    run: Callable[[int, int, torch.Tensor], torch.Tensor], state_pool: torch.Tensor,
    query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None, dtype: torch.dtype,
) -> None:  # fmt: skip
    """The chunked driver: ``run(start, end, state)`` takes one non-empty sequence's rows from
    its initial state (writing their outputs) and returns its final state."""
    bounds = query_start_loc.tolist()
    slots = state_indices.long()
    states = initial_states(state_pool, slots, has_initial_state, dtype)
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if end == start:
            continue
        state_pool[slots[i]] = run(start, end, states[i]).to(state_pool.dtype)


def cpu_takes(state_pool: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """The C++ recurrent ops take an fp32 state pool and ``tensors`` of one dtype, fp32 or bf16."""
    dtypes = {t.dtype for t in tensors}
    return (
        state_pool.dtype == torch.float32
        and len(dtypes) == 1
        and dtypes <= {torch.float32, torch.bfloat16}
    )


def choose_backend(device: torch.device, backend: str, cpu_fits: bool) -> str:
    """``select_backend``'s choice, with "cpu" falling back to "torch" where the C++ op does not
    take the arguments (``cpu_fits`` False)."""
    from kernels import select_backend

    chosen = select_backend(device, backend)
    return "torch" if chosen == "cpu" and not cpu_fits else chosen


def fp32(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as a contiguous fp32 tensor (None stays None)."""
    return None if t is None else t.float().contiguous()


def cpu_slot_args(
    query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``query_start_loc`` and ``state_indices`` as contiguous int64, ``has_initial_state`` as a
    contiguous bool tensor (or None): what the C++ ops check for. Also requires the C++ library."""
    from kernels import cpu_attention

    cpu_attention._require()
    has_initial = None
    if has_initial_state is not None:
        has_initial = has_initial_state.to(torch.bool).contiguous()
    return query_start_loc.long().contiguous(), state_indices.long().contiguous(), has_initial
