// The gated delta rule (Gated DeltaNet) for CPUs, registered as pagedq::gated_delta_rule: the
// twin of kernels/gated_delta.py over a varlen batch with a state slot per sequence.
//
// recurrent_cpu.h's run_delta_rule with one decay per head: one work item is (sequence, value
// head), longest first. An item walks its tokens in order on the slot's fp32 state
// [k_dim, v_dim] in place, two passes over the state per token:
//   pass 1: S *= exp(g); kv_mem = k^T S          pass 2: S += k delta^T; o = q^T S
// with delta = beta (v - kv_mem). This is the recurrent form for every sequence, prefill chunks
// included: on a CPU the chunked form saves no arithmetic (its matmuls do the same state reads
// and writes per token plus the intra-chunk system), and one head's state (64 KiB at 128 x 128)
// stays in L2 between tokens.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

#include "recurrent_cpu.h"

namespace {

namespace rec = pagedq_recurrent;

void gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& g, const at::Tensor& beta, at::Tensor& state_pool,
                      const at::Tensor& query_start_loc, const at::Tensor& state_indices,
                      const std::optional<at::Tensor>& has_initial_state, bool use_qk_l2norm,
                      double scale, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0),
              "gated_delta_rule: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(v.size(1) % q.size(1) == 0, "gated_delta_rule: num_v_heads ", v.size(1),
              " is not a multiple of num_k_heads ", q.size(1));
  rec::check_qkv("gated_delta_rule", q, k, v, out);
  TORCH_CHECK(g.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat &&
                  g.dim() == 2 && g.size(0) == q.size(0) && g.size(1) == v.size(1) &&
                  beta.sizes() == g.sizes() && g.stride(1) == 1 && beta.stride(1) == 1,
              "gated_delta_rule: g and beta must be fp32 [num_tokens, num_v_heads]");
  rec::check_state_pool("gated_delta_rule", state_pool, v.size(1), q.size(2), v.size(2),
                        "num_v_heads, k_dim, v_dim");
  rec::check_slots("gated_delta_rule", query_start_loc, state_indices, has_initial_state,
                   state_pool.size(0));
  rec::delta_rule("gated_delta_rule", q, k, v, g, beta, state_pool, query_start_loc,
                  state_indices, has_initial_state, use_qk_l2norm, scale, out,
                  /*per_channel_decay=*/false);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedq, m) {
  m.def(
      "gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
      "Tensor(a!) state_pool, Tensor query_start_loc, Tensor state_indices, "
      "Tensor? has_initial_state, bool use_qk_l2norm, float scale, Tensor(b!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pagedq, CPU, m) { m.impl("gated_delta_rule", &gated_delta_rule); }
