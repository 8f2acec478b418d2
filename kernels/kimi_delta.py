"""Kimi Delta Attention (KDA, Kimi Linear's linear attention) over a varlen batch.

The gated delta rule of ``kernels/gated_delta.py`` with a decay per key channel instead of one
per head. Each sequence ``i`` of a flat batch owns rows ``query_start_loc[i]:query_start_loc
[i+1]`` of ``q``/``k``/``g`` ``[num_tokens, num_heads, k_dim]``, ``v`` ``[num_tokens, num_heads,
v_dim]`` and ``beta`` ``[num_tokens, num_heads]``, and one slot ``state_indices[i]`` of the
recurrent state pool ``[num_slots, num_heads, k_dim, v_dim]`` (fp32). Kimi Linear has one head
count for q, k and v, so there is no key-head sharing here.

Per token, with ``q``, ``k`` l2-normalised (``x / sqrt(sum(x^2) + 1e-6)``) and ``q`` scaled by
``k_dim ** -0.5``, as transformers' ``recurrent_kimi_delta_attention``::

    S = diag(exp(g)) S;  S += k (beta * (v - k^T S))^T;  o = q^T S

The decay comes first: the token's own write is not decayed. A call starts from the slot's state
(zero where ``has_initial_state[i]`` is False) and writes the final state back to the slots of
sequences with at least one token, so a prompt split over several engine steps equals one pass.

- ``kimi_delta_rule_recurrent_torch``: token by token, all sequences at once (the decode form).
- ``kimi_delta_rule_chunked_torch``: chunks of 64 tokens per sequence in the WY form (FLA's
  ``chunk_kda``): the prefill form.
- ``kimi_delta_rule``: the dispatch: Triton on CUDA, C++ on the CPU (``kernels/csrc/
  kimi_delta_cpu.cpp``), else the reference (decodes recurrent, longer sequences chunked).

Everything runs in fp32 (float64 when the inputs or the pool are float64, to check the fp32
forms against), and the output is rounded once to ``v``'s dtype.
"""

from __future__ import annotations

import torch

from kernels.gated_delta import delta_rule_chunked, delta_rule_recurrent
from kernels.shape_checks import check_kimi_delta
from kernels.state_slots import choose_backend, compute_dtype, cpu_slot_args, cpu_takes, fp32

CHUNK_SIZE = 64
SUB_CHUNK = 16  # rows of the per-element products inside a chunk (_decayed_products)


def kimi_delta_rule_recurrent_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True,
    scale: float | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The token-by-token form (``delta_rule_recurrent`` with a decay per key channel)."""
    check_kimi_delta(q, k, v, g, beta, state_pool, query_start_loc, state_indices)
    args = (q, k, v, g, beta, state_pool, query_start_loc, state_indices, has_initial_state)
    dtype = compute_dtype(q, v, g, state_pool)
    return delta_rule_recurrent(*args, use_qk_l2norm, scale, out, dtype)


def _decayed_products(x: torch.Tensor, y: torch.Tensor, cum: torch.Tensor) -> torch.Tensor:
    """``m[h, i, j] = sum_c x_ic y_jc exp(cum_ic - cum_jc)`` for ``i >= j``, 0 above: x, y, cum
    ``[H, n, K]``.

    The per-channel decay does not factor as ``exp(cum_i) * exp(-cum_j)`` without overflow (a
    chunk's decay can pass exp(88) on a channel), so rows go in sub-chunks of ``SUB_CHUNK``: the
    columns before a sub-chunk in one matmul, both factors taken relative to the sub-chunk's
    first token (each a decay over a span of tokens, so at most 1); the sub-chunk's own
    triangle per element. About 4x less work than the per-element product over the chunk."""
    n = x.shape[1]
    m = x.new_zeros(x.shape[0], n, n)
    for s in range(0, n, SUB_CHUNK):
        rows = slice(s, s + SUB_CHUNK)
        c, ref = cum[:, rows], cum[:, s : s + 1]
        if s:
            earlier = y[:, :s] * (ref - cum[:, :s]).exp()
            m[:, rows, :s] = (x[:, rows] * (c - ref).exp()) @ earlier.transpose(1, 2)
        size = c.shape[1]
        lower = torch.ones(size, size, dtype=torch.bool, device=x.device).tril()
        rel = (c[:, :, None] - c[:, None]).masked_fill(~lower[:, :, None], float("-inf"))
        m[:, rows, rows] = torch.einsum("hic,hijc,hjc->hij", x[:, rows], rel.exp(), y[:, rows])
    return m


def _chunked_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One sequence, heads first: q/k/g ``[H, L, K]``, v ``[H, L, V]``, beta ``[H, L]``,
    state ``[H, K, V]``; returns ``(o [H, L, V], final state)``. Every exponent is a decay over
    a span of tokens (so never positive): inside the chunk, from its start, to its end."""
    out = torch.empty_like(v)
    for start in range(0, q.shape[1], chunk_size):
        sl = slice(start, start + chunk_size)
        qc, kc, vc, bc = q[:, sl], k[:, sl], v[:, sl], beta[:, sl, None]
        n = qc.shape[1]
        cum = g[:, sl].cumsum(1)  # [H, n, K] log decay from the chunk's start through token i
        # (I + A) u = beta v with A_ij = beta_i sum_c k_ic k_jc decay_c(j -> i), i > j (WY form)
        a = _decayed_products(kc * bc, kc, cum).tril(-1)
        eye = torch.eye(n, dtype=q.dtype, device=q.device).expand_as(a)
        rhs = torch.cat([vc * bc, kc * bc * cum.exp()], dim=-1)
        solved = torch.linalg.solve_triangular(a + eye, rhs, upper=False, unitriangular=True)
        u, w = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]
        v_new = u - w @ state  # what each token writes, net of what the old state predicts
        out[:, sl] = (qc * cum.exp()) @ state + _decayed_products(qc, kc, cum) @ v_new
        tail = (cum[:, -1:] - cum).exp()  # [H, n, K] decay from token j to the chunk's end
        state = state * cum[:, -1, :, None].exp() + (kc * tail).transpose(1, 2) @ v_new
    return out, state


def kimi_delta_rule_chunked_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True,
    scale: float | None = None, out: torch.Tensor | None = None, chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:  # fmt: skip
    """The chunked form, one sequence at a time, chunks of ``chunk_size`` from its first row."""
    check_kimi_delta(q, k, v, g, beta, state_pool, query_start_loc, state_indices)
    args = (q, k, v, g, beta, state_pool, query_start_loc, state_indices, has_initial_state)
    dtype = compute_dtype(q, v, g, state_pool)
    return delta_rule_chunked(_chunked_one, chunk_size, *args, use_qk_l2norm, scale, out, dtype)


def kimi_delta_rule_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True,
    scale: float | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The reference of a mixed step: a decode-only batch steps recurrently, any other batch
    goes chunked (a one-token sequence is one chunk of one)."""
    args = (q, k, v, g, beta, state_pool, query_start_loc, state_indices, has_initial_state)
    if q.shape[0] == state_indices.shape[0]:  # every sequence has exactly one token
        return kimi_delta_rule_recurrent_torch(*args, use_qk_l2norm, scale, out)
    return kimi_delta_rule_chunked_torch(*args, use_qk_l2norm, scale, out)


def kimi_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True,
    scale: float | None = None, out: torch.Tensor | None = None, backend: str = "auto",
) -> torch.Tensor:  # fmt: skip
    """Kimi Delta Attention of one linear-attention layer over a step's varlen batch; returns
    ``[num_tokens, num_heads, v_dim]`` in ``v``'s dtype and updates ``state_pool`` in place."""
    args = (q, k, v, g, beta, state_pool, query_start_loc, state_indices, has_initial_state)
    cpu_fits = cpu_takes(state_pool, q, k, v) and g.dtype != torch.float64
    chosen = choose_backend(q.device, backend, cpu_fits)
    if chosen == "triton":
        from kernels.triton_kimi_delta import kimi_delta_rule_triton

        return kimi_delta_rule_triton(*args, use_qk_l2norm, scale, out)
    if chosen == "cpu":
        return kimi_delta_rule_cpu(*args, use_qk_l2norm, scale, out)
    return kimi_delta_rule_torch(*args, use_qk_l2norm, scale, out)


def kimi_delta_rule_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True,
    scale: float | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """C++ twin of the reference (``kernels/csrc/kimi_delta_cpu.cpp``): fp32 state in place,
    q/k/v fp32 or bf16 (one dtype), the recurrent form for every sequence."""
    check_kimi_delta(q, k, v, g, beta, state_pool, query_start_loc, state_indices)
    slot_args = cpu_slot_args(query_start_loc, state_indices, has_initial_state)
    out = torch.empty_like(v) if out is None else out
    torch.ops.pagedq.kimi_delta_rule(
        q, k, v, fp32(g), fp32(beta), state_pool, *slot_args, use_qk_l2norm,
        float(q.shape[-1] ** -0.5 if scale is None else scale), out,
    )  # fmt: skip
    return out
