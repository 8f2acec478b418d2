"""The gated delta rule (Gated DeltaNet: Qwen3.5, Qwen3-Next linear attention) over a varlen batch.

Each sequence ``i`` of a flat batch owns rows ``query_start_loc[i]:query_start_loc[i+1]`` of
``q``/``k`` ``[num_tokens, num_k_heads, k_dim]``, ``v`` ``[num_tokens, num_v_heads, v_dim]`` and
``g``/``beta`` ``[num_tokens, num_v_heads]``, and one slot ``state_indices[i]`` of the recurrent
state pool ``[num_slots, num_v_heads, k_dim, v_dim]`` (fp32). Key head ``h`` serves value heads
``h * r .. h * r + r - 1`` (``r = num_v_heads // num_k_heads``, transformers' repeat_interleave).

Per token, with ``q``, ``k`` l2-normalised and ``q`` scaled by ``k_dim ** -0.5``::

    S = exp(g) * S;  S += k (beta * (v - k^T S))^T;  o = q^T S

A call starts from the slot's state (zero where ``has_initial_state[i]`` is False) and writes
the final state back, so a prompt split over several engine steps equals one pass.

- ``gated_delta_rule_recurrent_torch``: token by token, all sequences of the batch at once (the
  decode form).
- ``gated_delta_rule_chunked_torch``: chunks of 64 tokens per sequence, the WY/UT form of the
  DeltaNet paper (matmuls inside a chunk, the state carried between chunks): the prefill form.
- ``gated_delta_rule``: the dispatch: Triton on CUDA, C++ on the CPU (``kernels/csrc/
  gated_delta_cpu.cpp``), else the reference (decodes recurrent, longer sequences chunked).
- ``delta_rule_recurrent``, ``delta_rule_chunked`` (with ``prepare_qk``): what the two delta
  rules share; ``kernels/kimi_delta.py`` runs on them with a decay per key channel.

Everything runs in fp32 (float64 when the inputs or the pool are float64, to check the fp32
forms against), and the output is rounded once to ``v``'s dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.shape_checks import check_gated_delta
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


def gdn_gating(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, beta)``: the log decay ``-exp(A_log) * softplus(a + dt_bias)`` (fp32) and
    ``sigmoid(b)`` (in ``b``'s dtype), as transformers' Qwen3.5 computes them."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the FLA library's, as transformers')."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_qk_l2norm: bool,
    scale: float | None, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """q, k in ``dtype``, normalised (after the cast, as FLA does), q scaled (by ``k_dim ** -0.5``
    where ``scale`` is None), repeated to one head per value head."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k = q.to(dtype), k.to(dtype)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    ratio = num_v_heads // k.shape[1]
    if ratio > 1:
        q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
    return q, k


def delta_rule_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None, use_qk_l2norm: bool, scale: float | None,
    out: torch.Tensor | None, dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """The token-by-token form of both delta rules (arguments checked), in ``dtype``: step ``t``
    advances every sequence that has a ``t``-th token. ``g`` is ``[T, H, K]`` for a decay per key
    channel (a row of S; Kimi Delta Attention) or ``[T, H, 1]`` for one per head."""
    qn, kn = prepare_qk(q, k, v.shape[1], use_qk_l2norm, scale, dtype)
    vv, decay, beta_ = v.to(dtype), g.to(dtype).exp(), beta.to(dtype)
    out = torch.empty_like(v) if out is None else out

    def step(s: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        s = s * decay[rows][:, :, :, None]
        kt = kn[rows]
        kv_mem = torch.einsum("bhkv,bhk->bhv", s, kt)
        delta = (vv[rows] - kv_mem) * beta_[rows][:, :, None]
        s = s + kt[:, :, :, None] * delta[:, :, None, :]
        out[rows] = torch.einsum("bhkv,bhk->bhv", s, qn[rows]).to(out.dtype)
        return s

    scan_tokens(step, state_pool, query_start_loc, state_indices, has_initial_state, dtype)
    return out


def delta_rule_chunked(
    chunked_one: Callable, chunk_size: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor, state_pool: torch.Tensor, query_start_loc: torch.Tensor,
    state_indices: torch.Tensor, has_initial_state: torch.Tensor | None, use_qk_l2norm: bool,
    scale: float | None, out: torch.Tensor | None, dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """The chunked driver of both delta rules (arguments checked), in ``dtype``: one sequence at
    a time, heads first, through ``chunked_one(q, k, v, g, beta, state, chunk_size) -> (o, final
    state)``."""
    qn, kn = prepare_qk(q, k, v.shape[1], use_qk_l2norm, scale, dtype)
    out = torch.empty_like(v) if out is None else out

    def run(start: int, end: int, state: torch.Tensor) -> torch.Tensor:
        heads_first = [x[start:end].transpose(0, 1).to(dtype) for x in (qn, kn, v, g, beta)]
        o, state = chunked_one(*heads_first, state, chunk_size)
        out[start:end] = o.transpose(0, 1).to(out.dtype)
        return state

    scan_sequences(run, state_pool, query_start_loc, state_indices, has_initial_state, dtype)
    return out


def gated_delta_rule_recurrent_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True,
    scale: float | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The token-by-token form (``delta_rule_recurrent`` with one decay per head)."""
    check_gated_delta(q, k, v, g, beta, state_pool, query_start_loc, state_indices)
    args = (state_pool, query_start_loc, state_indices, has_initial_state, use_qk_l2norm, scale)
    dtype = compute_dtype(q, v, state_pool)
    return delta_rule_recurrent(q, k, v, g[:, :, None], beta, *args, out, dtype)


def _chunked_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One sequence, heads first: q/k ``[H, L, K]``, v ``[H, L, V]``, g/beta ``[H, L]``,
    state ``[H, K, V]``; returns ``(o [H, L, V], final state)``."""
    out = torch.empty_like(v)
    for start in range(0, q.shape[1], chunk_size):
        sl = slice(start, start + chunk_size)
        qc, kc, vc, bc = q[:, sl], k[:, sl], v[:, sl], beta[:, sl, None]
        n = qc.shape[1]
        cum = g[:, sl].cumsum(-1)  # log of the decay from the chunk's start through token i
        rel = cum[:, :, None] - cum[:, None, :]  # decay from token j to token i (i >= j)
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        rel_decay = rel.masked_fill(~lower, float("-inf")).exp()
        # Within a chunk the delta rule's updates solve a unit lower-triangular system
        # (I + A) u = beta v with A_ij = beta_i k_i . k_j decay(j -> i) for i > j (WY form).
        a = ((kc * bc) @ kc.transpose(1, 2) * rel_decay).tril(-1)
        eye = torch.eye(n, dtype=q.dtype, device=q.device).expand_as(a)
        rhs = torch.cat([vc * bc, kc * bc * cum[:, :, None].exp()], dim=-1)
        solved = torch.linalg.solve_triangular(a + eye, rhs, upper=False, unitriangular=True)
        u, w = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]
        v_new = u - w @ state  # what each token writes, net of what the old state predicts
        scores = qc @ kc.transpose(1, 2) * rel_decay
        out[:, sl] = (qc * cum[:, :, None].exp()) @ state + scores @ v_new
        tail = (cum[:, -1:] - cum).exp()[:, :, None]  # decay from token j to the chunk's end
        state = state * cum[:, -1, None, None].exp() + (kc * tail).transpose(1, 2) @ v_new
    return out, state


def gated_delta_rule_chunked_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True,
    scale: float | None = None, out: torch.Tensor | None = None, chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:  # fmt: skip
    """The chunked form, one sequence at a time, chunks of ``chunk_size`` from its first row."""
    check_gated_delta(q, k, v, g, beta, state_pool, query_start_loc, state_indices)
    args = (q, k, v, g, beta, state_pool, query_start_loc, state_indices, has_initial_state)
    dtype = compute_dtype(q, v, state_pool)
    return delta_rule_chunked(_chunked_one, chunk_size, *args, use_qk_l2norm, scale, out, dtype)


def gated_delta_rule_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True,
    scale: float | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The reference of a mixed step: a decode-only batch steps recurrently, any other batch
    goes chunked (a one-token sequence is one chunk of one)."""
    args = (q, k, v, g, beta, state_pool, query_start_loc, state_indices, has_initial_state)
    if q.shape[0] == state_indices.shape[0]:  # every sequence has exactly one token
        return gated_delta_rule_recurrent_torch(*args, use_qk_l2norm, scale, out)
    return gated_delta_rule_chunked_torch(*args, use_qk_l2norm, scale, out)


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True,
    scale: float | None = None, out: torch.Tensor | None = None, backend: str = "auto",
) -> torch.Tensor:  # fmt: skip
    """The gated delta rule of one linear-attention layer over a step's varlen batch; returns
    ``[num_tokens, num_v_heads, v_dim]`` in ``v``'s dtype and updates ``state_pool`` in place."""
    args = (q, k, v, g, beta, state_pool, query_start_loc, state_indices, has_initial_state)
    chosen = choose_backend(q.device, backend, cpu_takes(state_pool, q, k, v))
    if chosen == "triton":
        from kernels.triton_gated_delta import gated_delta_rule_triton

        return gated_delta_rule_triton(*args, use_qk_l2norm, scale, out)
    if chosen == "cpu":
        return gated_delta_rule_cpu(*args, use_qk_l2norm, scale, out)
    return gated_delta_rule_torch(*args, use_qk_l2norm, scale, out)


def gated_delta_rule_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True,
    scale: float | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """C++ twin of the reference (``kernels/csrc/gated_delta_cpu.cpp``): fp32 state in place,
    q/k/v fp32 or bf16 (one dtype), the recurrent form for every sequence."""
    check_gated_delta(q, k, v, g, beta, state_pool, query_start_loc, state_indices)
    slot_args = cpu_slot_args(query_start_loc, state_indices, has_initial_state)
    out = torch.empty_like(v) if out is None else out
    torch.ops.pagedq.gated_delta_rule(
        q, k, v, fp32(g), fp32(beta), state_pool, *slot_args, use_qk_l2norm,
        float(q.shape[-1] ** -0.5 if scale is None else scale), out,
    )  # fmt: skip
    return out
