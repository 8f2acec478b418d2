"""The Mamba-2 selective state-space scan (SSD; Granite 4, Falcon-H1) over a varlen batch.

Each sequence ``i`` of a flat batch owns rows ``query_start_loc[i]:query_start_loc[i+1]`` of
``x`` ``[num_tokens, num_heads, head_dim]``, ``dt`` ``[num_tokens, num_heads]`` (raw, before
bias and softplus) and ``B``/``C`` ``[num_tokens, num_groups, state_dim]``, and one slot
``state_indices[i]`` of the state pool ``[num_slots, num_heads, head_dim, state_dim]`` (fp32).
Head ``h`` reads group ``h // (num_heads // num_groups)`` of ``B`` and ``C``.

Per token and head, with ``A = -exp(A_log)`` (one scalar per head)::

    d = clamp(softplus(dt + dt_bias), *dt_limit);  S = exp(d A) S + d x B^T;  y = S C + D x

A decaying linear attention (MiniMax's lightning attention: ``S = exp(-slope) S + v k^T``,
``o = S q``) is the same recurrence with a unit step, ``x = v``, ``B = k``, ``C = q`` and a
group per head: ``lightning_attention``.

Mamba-1's selective scan is the same recurrence with a decay per state dimension: ``A``
``[num_heads, state_dim]``, one head per channel (``head_dim`` 1) and one group; the SSD
(chunked) form needs one decay per head, so such a scan always runs in the recurrent form.

A call starts from the slot's state (zero where ``has_initial_state[i]`` is False) and writes
the final state back, so a prompt split over several engine steps equals one pass.

- ``mamba_chunk_scan_recurrent_torch``: token by token, all sequences of the batch at once (the
  decode form).
- ``mamba_chunk_scan_chunked_torch``: chunks of 64 tokens per sequence, the SSD form of the
  Mamba-2 paper (inside a chunk ``y = (C B^T * L) (d x)`` with ``L`` the causal decay; the state
  carried between chunks): the prefill form.
- ``mamba_chunk_scan``: the dispatch: Triton on CUDA, C++ on the CPU (``kernels/csrc/
  mamba_ssm_cpu.cpp``), else the reference (decodes recurrent, longer sequences chunked).

Everything runs in fp32 (float64 when the inputs or the pool are float64, to check the fp32
forms against), and the output is rounded once to ``x``'s dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.shape_checks import check_mamba_ssm
from kernels.state_slots import (
    choose_backend,
    compute_dtype,
    cpu_slot_args,
    cpu_takes,
    fp32,
    scan_sequences,
    scan_tokens,
)

CHUNK_SIZE = 64
NO_DT_LIMIT = (0.0, float("inf"))


def _step_sizes(
    dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_limit: tuple[float, float],
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """``clamp(softplus(dt + dt_bias), *dt_limit)`` in ``dtype``, ``[num_tokens, num_heads]``."""
    dt = dt.to(dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    return F.softplus(dt).clamp(dt_limit[0], dt_limit[1])


def _per_head(bc: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """B or C ``[T, groups, N]`` as ``[T, heads, N]``: each group serves consecutive heads."""
    return bc.to(dtype).repeat_interleave(num_heads // bc.shape[1], dim=1)


def _skip(x: torch.Tensor, D: torch.Tensor | None) -> torch.Tensor | float:
    """The ``D x`` skip term (``x`` already in the compute dtype)."""
    return 0.0 if D is None else D.to(x.dtype)[:, None] * x


def mamba_chunk_scan_recurrent_torch(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None, dt_bias: torch.Tensor | None, state_pool: torch.Tensor,
    query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    dt_limit: tuple[float, float] = NO_DT_LIMIT, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The token-by-token form: step ``t`` advances every sequence that has a ``t``-th token."""
    check_mamba_ssm(x, dt, A, B, C, D, dt_bias, state_pool, query_start_loc, state_indices,
                    has_initial_state)  # fmt: skip
    dtype = compute_dtype(x, state_pool)
    num_heads = x.shape[1]
    xx, d = x.to(dtype), _step_sizes(dt, dt_bias, dt_limit, dtype)
    # [T, H, 1, 1] for a decay per head, [T, H, 1, N] for one per state dimension (Mamba-1)
    decay = (d[..., None] * A.to(dtype).view(A.shape[0], -1)).exp()[:, :, None, :]
    Bh, Ch = _per_head(B, num_heads, dtype), _per_head(C, num_heads, dtype)
    out = torch.empty_like(x) if out is None else out

    def step(s: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        dx = d[rows][:, :, None] * xx[rows]  # [b, H, P]
        s = s * decay[rows] + dx[..., None] * Bh[rows][:, :, None]
        y = torch.einsum("bhpn,bhn->bhp", s, Ch[rows]) + _skip(xx[rows], D)
        out[rows] = y.to(out.dtype)
        return s

    scan_tokens(step, state_pool, query_start_loc, state_indices, has_initial_state, dtype)
    return out


def _chunked_one(
    x: torch.Tensor, d: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    state: torch.Tensor, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One sequence, heads first: x ``[H, L, P]``, d ``[H, L]``, B/C ``[H, L, N]``, A ``[H]``,
    state ``[H, P, N]``; returns ``(y [H, L, P] without the D term, final state)``."""
    out = torch.empty_like(x)
    for start in range(0, x.shape[1], chunk_size):
        sl = slice(start, start + chunk_size)
        dx, Bc, Cc = x[:, sl] * d[:, sl, None], B[:, sl], C[:, sl]
        n = dx.shape[1]
        cum = (d[:, sl] * A[:, None]).cumsum(-1)  # log of the decay from the chunk's start
        rel = cum[:, :, None] - cum[:, None, :]  # decay from token j to token i (i >= j)
        lower = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        L = rel.masked_fill(~lower, float("-inf")).exp()
        y_diag = (Cc @ Bc.transpose(1, 2) * L) @ dx
        y_off = cum.exp()[:, :, None] * (Cc @ state.transpose(1, 2))
        out[:, sl] = y_diag + y_off
        tail = (cum[:, -1:] - cum).exp()[:, :, None]  # decay from token j to the chunk's end
        state = state * cum[:, -1, None, None].exp() + (dx * tail).transpose(1, 2) @ Bc
    return out, state


def mamba_chunk_scan_chunked_torch(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None, dt_bias: torch.Tensor | None, state_pool: torch.Tensor,
    query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    dt_limit: tuple[float, float] = NO_DT_LIMIT, out: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:  # fmt: skip
    """The SSD form, one sequence at a time, chunks of ``chunk_size`` from its first row (one
    decay per head: ``A`` ``[num_heads]``)."""
    check_mamba_ssm(x, dt, A, B, C, D, dt_bias, state_pool, query_start_loc, state_indices,
                    has_initial_state)  # fmt: skip
    if A.dim() != 1:
        raise ValueError(f"the chunked scan takes A [num_heads], not {tuple(A.shape)}")
    dtype = compute_dtype(x, state_pool)
    num_heads = x.shape[1]
    xx, d, AA = x.to(dtype), _step_sizes(dt, dt_bias, dt_limit, dtype), A.to(dtype)
    Bh, Ch = _per_head(B, num_heads, dtype), _per_head(C, num_heads, dtype)
    out = torch.empty_like(x) if out is None else out

    def run(start: int, end: int, state: torch.Tensor) -> torch.Tensor:
        xs, ds, Bs, Cs = (t[start:end].transpose(0, 1) for t in (xx, d, Bh, Ch))
        y, state = _chunked_one(xs, ds, AA, Bs, Cs, state, chunk_size)
        out[start:end] = (y.transpose(0, 1) + _skip(xx[start:end], D)).to(out.dtype)
        return state

    scan_sequences(run, state_pool, query_start_loc, state_indices, has_initial_state, dtype)
    return out


def mamba_chunk_scan_torch(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None, dt_bias: torch.Tensor | None, state_pool: torch.Tensor,
    query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    dt_limit: tuple[float, float] = NO_DT_LIMIT, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The reference of a mixed step: a decode-only batch steps recurrently, any other batch
    goes chunked (a one-token sequence is one chunk of one); a decay per state dimension
    (Mamba-1) always steps recurrently."""
    args = (x, dt, A, B, C, D, dt_bias, state_pool, query_start_loc, state_indices,
            has_initial_state, dt_limit, out)  # fmt: skip
    if x.shape[0] == state_indices.shape[0] or A.dim() == 2:
        return mamba_chunk_scan_recurrent_torch(*args)
    return mamba_chunk_scan_chunked_torch(*args)


def mamba_chunk_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None, dt_bias: torch.Tensor | None, state_pool: torch.Tensor,
    query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    dt_limit: tuple[float, float] = NO_DT_LIMIT, out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:  # fmt: skip
    """The Mamba-2 scan of one layer over a step's varlen batch; returns
    ``[num_tokens, num_heads, head_dim]`` in ``x``'s dtype (or in ``out``, which may be fp32
    for a bf16 ``x``: the model keeps the output unrounded) and updates ``state_pool`` in
    place."""
    args = (x, dt, A, B, C, D, dt_bias, state_pool, query_start_loc, state_indices,
            has_initial_state, dt_limit, out)  # fmt: skip
    chosen = choose_backend(x.device, backend, cpu_takes(state_pool, x, B, C))
    if chosen == "triton":
        from kernels.triton_mamba_ssm import mamba_chunk_scan_triton

        return mamba_chunk_scan_triton(*args)
    if chosen == "cpu":
        return mamba_chunk_scan_cpu(*args)
    return mamba_chunk_scan_torch(*args)


def mamba_chunk_scan_cpu(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None, dt_bias: torch.Tensor | None, state_pool: torch.Tensor,
    query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    dt_limit: tuple[float, float] = NO_DT_LIMIT, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """C++ twin of the reference (``kernels/csrc/mamba_ssm_cpu.cpp``): fp32 state in place,
    x/B/C fp32 or bf16 (one dtype), ``out`` in that dtype or fp32, the recurrent form for every
    sequence."""
    check_mamba_ssm(x, dt, A, B, C, D, dt_bias, state_pool, query_start_loc, state_indices,
                    has_initial_state)  # fmt: skip
    slot_args = cpu_slot_args(query_start_loc, state_indices, has_initial_state)
    out = torch.empty_like(x) if out is None else out
    torch.ops.pagedq.mamba_chunk_scan(
        x, fp32(dt), fp32(A), B, C, fp32(D), fp32(dt_bias), state_pool, *slot_args,
        float(dt_limit[0]), float(dt_limit[1]), out,
    )  # fmt: skip
    return out


UNIT_STEP = (1.0, 1.0)  # clamp(softplus(0), 1, 1) = 1 in every form


def lightning_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
    state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None, out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:  # fmt: skip
    """MiniMax's lightning attention over a varlen batch: per head, ``S = exp(-slope) S +
    v k^T`` and ``o = S q`` (q, k, v ``[num_tokens, heads, head_dim]``, ``slope`` ``[heads]``,
    the state ``[slots, heads, v_dim, k_dim]``): the scan with a unit step."""
    dt = torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)
    return mamba_chunk_scan(
        v, dt, -slope.float(), k, q, None, None, state_pool, query_start_loc, state_indices,
        has_initial_state, UNIT_STEP, out=out, backend=backend,
    )  # fmt: skip
