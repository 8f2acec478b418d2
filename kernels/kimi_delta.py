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

from kernels.gated_delta import l2norm
from kernels.shape_checks import check_kimi_delta

CHUNK_SIZE = 64
SUB_CHUNK = 16  # rows of the per-element products inside a chunk (_decayed_products)


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _prepare_qk(
    q: torch.Tensor, k: torch.Tensor, use_qk_l2norm: bool, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k in ``dtype``, normalised (after the cast, as FLA does), q scaled."""
    q, k = q.to(dtype), k.to(dtype)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * scale, k


def _initial_states(
    state_pool: torch.Tensor, slots: torch.Tensor, has_initial_state: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    states = state_pool[slots].to(dtype)
    if has_initial_state is not None:
        states = states * has_initial_state.to(states.device, torch.bool)[:, None, None, None]
    return states


def kimi_delta_rule_recurrent_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True,
    scale: float | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The token-by-token form: step ``t`` advances every sequence that has a ``t``-th token."""
    check_kimi_delta(q, k, v, g, beta, state_pool, query_start_loc, state_indices)
    dtype = _compute_dtype(q, v, g, state_pool)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qn, kn = _prepare_qk(q, k, use_qk_l2norm, scale, dtype)
    vv, decay, beta_ = v.to(dtype), g.to(dtype).exp(), beta.to(dtype)
    out = torch.empty_like(v) if out is None else out
    starts, ends = query_start_loc[:-1].long(), query_start_loc[1:].long()
    lens = ends - starts
    slots = state_indices.long()
    states = _initial_states(state_pool, slots, has_initial_state, dtype)
    for t in range(int(lens.max()) if lens.numel() else 0):
        active = (lens > t).nonzero().flatten()
        rows = starts[active] + t
        s = states[active] * decay[rows][:, :, :, None]  # one decay per key channel (row of S)
        kt = kn[rows]
        kv_mem = torch.einsum("bhkv,bhk->bhv", s, kt)
        delta = (vv[rows] - kv_mem) * beta_[rows][:, :, None]
        s = s + kt[:, :, :, None] * delta[:, :, None, :]
        out[rows] = torch.einsum("bhkv,bhk->bhv", s, qn[rows]).to(out.dtype)
        states[active] = s
    ran = lens > 0
    state_pool[slots[ran]] = states[ran].to(state_pool.dtype)
    return out


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
    dtype = _compute_dtype(q, v, g, state_pool)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qn, kn = _prepare_qk(q, k, use_qk_l2norm, scale, dtype)
    out = torch.empty_like(v) if out is None else out
    bounds = query_start_loc.tolist()
    slots = state_indices.long()
    states = _initial_states(state_pool, slots, has_initial_state, dtype)
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if end == start:
            continue
        heads_first = [x[start:end].transpose(0, 1).to(dtype) for x in (qn, kn, v, g, beta)]
        o, state = _chunked_one(*heads_first, states[i], chunk_size)
        out[start:end] = o.transpose(0, 1).to(out.dtype)
        state_pool[slots[i]] = state.to(state_pool.dtype)
    return out


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
    from kernels import select_backend

    args = (q, k, v, g, beta, state_pool, query_start_loc, state_indices, has_initial_state)
    chosen = select_backend(q.device, backend)
    if chosen == "triton":
        from kernels.triton_kimi_delta import kimi_delta_rule_triton

        return kimi_delta_rule_triton(*args, use_qk_l2norm, scale, out)
    if (
        chosen == "cpu"
        and state_pool.dtype == torch.float32
        and q.dtype in (torch.float32, torch.bfloat16)
        and q.dtype == k.dtype == v.dtype
        and g.dtype != torch.float64
    ):
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
    from kernels import cpu_attention

    check_kimi_delta(q, k, v, g, beta, state_pool, query_start_loc, state_indices)
    cpu_attention._require()
    out = torch.empty_like(v) if out is None else out
    has_initial = None if has_initial_state is None else has_initial_state.to(torch.bool)
    has_initial = None if has_initial is None else has_initial.contiguous()
    torch.ops.pagedq.kimi_delta_rule(
        q, k, v, g.float().contiguous(), beta.float().contiguous(), state_pool,
        query_start_loc.long().contiguous(), state_indices.long().contiguous(),
        has_initial, use_qk_l2norm,
        float(q.shape[-1] ** -0.5 if scale is None else scale), out,
    )  # fmt: skip
    return out
