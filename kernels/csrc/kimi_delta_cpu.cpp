// Kimi Delta Attention (KDA) for CPUs, registered as pagedq::kimi_delta_rule: the twin of
// kernels/kimi_delta.py over a varlen batch with a state slot per sequence.
//
// The gated delta rule of gated_delta_cpu.cpp with a decay per key channel: row i of a head's
// fp32 state [k_dim, v_dim] decays by exp(g[i]) rather than the whole state by one factor. One
// work item is (sequence, head); threads take items from a shared counter, longest first, so
// one long prompt does not leave the other threads idle. An item walks its tokens in order on
// the slot's state in place, two passes over the state per token:
//   pass 1: S[i] *= exp(g[i]); kv_mem = k^T S      pass 2: S += k delta^T; o = q^T S
// with delta = beta (v - kv_mem). The recurrent form for every sequence, prefill included, for
// the reason gated_delta_cpu.cpp gives (the chunked form saves no arithmetic on a CPU).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

struct Item {
  int64_t seq;
  int64_t head;
  int64_t len;
};

template <typename T>
void load_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// x * scale / sqrt(sum(x^2) + 1e-6): FLA's l2norm, as transformers' Kimi Linear.
void l2normalise(float* x, int64_t n, float scale) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = scale / std::sqrt(sum + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
         const at::Tensor& beta, at::Tensor& state_pool, const at::Tensor& query_start_loc,
         const at::Tensor& state_indices, const std::optional<at::Tensor>& has_initial_state,
         bool use_qk_l2norm, double scale, at::Tensor& out) {
  const int64_t num_seqs = state_indices.size(0);
  const int64_t num_heads = q.size(1), K = q.size(2), V = v.size(2);
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const int64_t* slots = state_indices.data_ptr<int64_t>();
  const bool* has_initial = has_initial_state ? has_initial_state->data_ptr<bool>() : nullptr;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float* gp = g.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  float* pool = state_pool.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t gs0 = g.stride(0), gs1 = g.stride(1), bs0 = beta.stride(0);
  const int64_t ps0 = state_pool.stride(0), ps1 = state_pool.stride(1);

  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = starts[s + 1] - starts[s];
    if (len == 0) continue;
    for (int64_t h = 0; h < num_heads; ++h) items.push_back({s, h, len});
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.len > b.len; });
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> buf(3 * K + 2 * V);
    float* __restrict__ qf = buf.data();
    float* __restrict__ kf = qf + K;
    float* __restrict__ decay = kf + K;
    float* __restrict__ kv = decay + K;
    float* __restrict__ o = kv + V;
    for (int64_t n = next.fetch_add(1); n < num_items; n = next.fetch_add(1)) {
      const Item& it = items[n];
      const int64_t h = it.head;
      float* __restrict__ S = pool + slots[it.seq] * ps0 + h * ps1;
      if (has_initial && !has_initial[it.seq]) std::fill(S, S + K * V, 0.f);
      for (int64_t t = starts[it.seq]; t < starts[it.seq + 1]; ++t) {
        load_float(qp + t * qs0 + h * qs1, qf, K);
        load_float(kp + t * ks0 + h * ks1, kf, K);
        if (use_qk_l2norm) {
          l2normalise(qf, K, fscale);
          l2normalise(kf, K, 1.f);
        } else {
          for (int64_t i = 0; i < K; ++i) qf[i] *= fscale;
        }
        const float* gt = gp + t * gs0 + h * gs1;
        for (int64_t i = 0; i < K; ++i) decay[i] = std::exp(gt[i]);
        const float b = bp[t * bs0 + h];
        std::fill(kv, kv + V, 0.f);
        for (int64_t i = 0; i < K; ++i) {
          float* __restrict__ row = S + i * V;
          const float ki = kf[i], di = decay[i];
          for (int64_t j = 0; j < V; ++j) {
            row[j] *= di;
            kv[j] += ki * row[j];
          }
        }
        const T* vt = vp + t * vs0 + h * vs1;
        for (int64_t j = 0; j < V; ++j) kv[j] = b * (static_cast<float>(vt[j]) - kv[j]);
        std::fill(o, o + V, 0.f);
        for (int64_t i = 0; i < K; ++i) {
          float* __restrict__ row = S + i * V;
          const float ki = kf[i], qi = qf[i];
          for (int64_t j = 0; j < V; ++j) {
            row[j] += ki * kv[j];
            o[j] += qi * row[j];
          }
        }
        T* ot = op + t * os0 + h * os1;
        for (int64_t j = 0; j < V; ++j) ot[j] = static_cast<T>(o[j]);
      }
    }
  });
}

void kimi_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& g, const at::Tensor& beta, at::Tensor& state_pool,
                     const at::Tensor& query_start_loc, const at::Tensor& state_indices,
                     const std::optional<at::Tensor>& has_initial_state, bool use_qk_l2norm,
                     double scale, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0) &&
                  v.size(1) == q.size(1),
              "kimi_delta_rule: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1,
              "kimi_delta_rule: q, k, v and out need unit stride in their last dim");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  q.scalar_type() == out.scalar_type() && out.sizes() == v.sizes(),
              "kimi_delta_rule: q, k, v and out must share a dtype (out shaped like v)");
  TORCH_CHECK(g.scalar_type() == at::kFloat && g.sizes() == q.sizes() && g.stride(2) == 1,
              "kimi_delta_rule: g must be fp32 [num_tokens, num_heads, k_dim], got ", g.sizes());
  TORCH_CHECK(beta.scalar_type() == at::kFloat && beta.dim() == 2 && beta.size(0) == q.size(0) &&
                  beta.size(1) == q.size(1) && beta.stride(1) == 1,
              "kimi_delta_rule: beta must be fp32 [num_tokens, num_heads], got ", beta.sizes());
  TORCH_CHECK(state_pool.scalar_type() == at::kFloat && state_pool.dim() == 4 &&
                  state_pool.size(1) == q.size(1) && state_pool.size(2) == q.size(2) &&
                  state_pool.size(3) == v.size(2) && state_pool.stride(3) == 1 &&
                  state_pool.stride(2) == v.size(2),
              "kimi_delta_rule: state_pool must be fp32 [num_slots, num_heads, k_dim, v_dim] "
              "with contiguous [k_dim, v_dim] states, got ", state_pool.sizes());
  TORCH_CHECK(query_start_loc.scalar_type() == at::kLong && state_indices.scalar_type() == at::kLong &&
                  query_start_loc.is_contiguous() && state_indices.is_contiguous() &&
                  query_start_loc.size(0) == state_indices.size(0) + 1,
              "kimi_delta_rule: query_start_loc [num_seqs + 1] and state_indices [num_seqs] int64");
  if (has_initial_state) {
    TORCH_CHECK(has_initial_state->scalar_type() == at::kBool && has_initial_state->is_contiguous() &&
                    has_initial_state->size(0) == state_indices.size(0),
                "kimi_delta_rule: has_initial_state must be bool [num_seqs]");
  }
  const int64_t* slots = state_indices.data_ptr<int64_t>();
  for (int64_t s = 0; s < state_indices.size(0); ++s) {
    TORCH_CHECK(slots[s] >= 0 && slots[s] < state_pool.size(0), "kimi_delta_rule: slot ",
                slots[s], " outside the pool of ", state_pool.size(0));
  }
  AT_DISPATCH_SWITCH(q.scalar_type(), "kimi_delta_rule",
                     AT_DISPATCH_CASE(at::kFloat, [&] {
                       run<float>(q, k, v, g, beta, state_pool, query_start_loc, state_indices,
                                  has_initial_state, use_qk_l2norm, scale, out);
                     }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       run<c10::BFloat16>(q, k, v, g, beta, state_pool, query_start_loc,
                                          state_indices, has_initial_state, use_qk_l2norm, scale,
                                          out);
                     }));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedq, m) {
  m.def(
      "kimi_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
      "Tensor(a!) state_pool, Tensor query_start_loc, Tensor state_indices, "
      "Tensor? has_initial_state, bool use_qk_l2norm, float scale, Tensor(b!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pagedq, CPU, m) { m.impl("kimi_delta_rule", &kimi_delta_rule); }
