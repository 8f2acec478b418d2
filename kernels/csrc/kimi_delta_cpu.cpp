// Kimi Delta Attention (KDA) for CPUs, registered as pagedq::kimi_delta_rule: the twin of
// kernels/kimi_delta.py over a varlen batch with a state slot per sequence.
//
// The gated delta rule of gated_delta_cpu.cpp with a decay per key channel: row i of a head's
// fp32 state [k_dim, v_dim] decays by exp(g[i]) rather than the whole state by one factor (both
// are recurrent_cpu.h's run_delta_rule). One work item is (sequence, head), longest first. An
// item walks its tokens in order on the slot's state in place, two passes over the state per
// token:
//   pass 1: S[i] *= exp(g[i]); kv_mem = k^T S      pass 2: S += k delta^T; o = q^T S
// with delta = beta (v - kv_mem). The recurrent form for every sequence, prefill included, for
// the reason gated_delta_cpu.cpp gives (the chunked form saves no arithmetic on a CPU).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

#include "recurrent_cpu.h"

namespace {

namespace rec = pagedq_recurrent;

void kimi_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& g, const at::Tensor& beta, at::Tensor& state_pool,
                     const at::Tensor& query_start_loc, const at::Tensor& state_indices,
                     const std::optional<at::Tensor>& has_initial_state, bool use_qk_l2norm,
                     double scale, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0) &&
                  v.size(1) == q.size(1),
              "kimi_delta_rule: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  rec::check_qkv("kimi_delta_rule", q, k, v, out);
  TORCH_CHECK(g.scalar_type() == at::kFloat && g.sizes() == q.sizes() && g.stride(2) == 1,
              "kimi_delta_rule: g must be fp32 [num_tokens, num_heads, k_dim], got ", g.sizes());
  TORCH_CHECK(beta.scalar_type() == at::kFloat && beta.dim() == 2 && beta.size(0) == q.size(0) &&
                  beta.size(1) == q.size(1) && beta.stride(1) == 1,
              "kimi_delta_rule: beta must be fp32 [num_tokens, num_heads], got ", beta.sizes());
  rec::check_state_pool("kimi_delta_rule", state_pool, q.size(1), q.size(2), v.size(2),
                        "num_heads, k_dim, v_dim");
  rec::check_slots("kimi_delta_rule", query_start_loc, state_indices, has_initial_state,
                   state_pool.size(0));
  rec::delta_rule("kimi_delta_rule", q, k, v, g, beta, state_pool, query_start_loc,
                  state_indices, has_initial_state, use_qk_l2norm, scale, out,
                  /*per_channel_decay=*/true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedq, m) {
  m.def(
      "kimi_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
      "Tensor(a!) state_pool, Tensor query_start_loc, Tensor state_indices, "
      "Tensor? has_initial_state, bool use_qk_l2norm, float scale, Tensor(b!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pagedq, CPU, m) { m.impl("kimi_delta_rule", &kimi_delta_rule); }
