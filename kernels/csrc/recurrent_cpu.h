// What the recurrent-state CPU ops share (gated_delta_cpu.cpp, kimi_delta_cpu.cpp,
// mamba_ssm_cpu.cpp; causal_conv1d_cpu.cpp takes the slot checks): the checks of a varlen batch
// with a state slot per sequence, the (sequence, head) work loop, the slot's state with
// has_initial_state, and the delta rules' kernel (run_delta_rule: the two differ only in how
// many decay factors a token has).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace pagedq_recurrent {

template <typename T>
inline void load_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// x * scale / sqrt(sum(x^2) + 1e-6): FLA's l2norm, as transformers' Qwen3.5 and Kimi Linear.
inline void l2normalise(float* x, int64_t n, float scale) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = scale / std::sqrt(sum + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

// query_start_loc [num_seqs + 1] and state_indices [num_seqs] int64, has_initial_state bool
// [num_seqs], every slot inside a pool of num_slots.
inline void check_slots(const char* op, const at::Tensor& query_start_loc,
                        const at::Tensor& state_indices,
                        const std::optional<at::Tensor>& has_initial_state, int64_t num_slots) {
  TORCH_CHECK(query_start_loc.scalar_type() == at::kLong &&
                  state_indices.scalar_type() == at::kLong && query_start_loc.is_contiguous() &&
                  state_indices.is_contiguous() &&
                  query_start_loc.size(0) == state_indices.size(0) + 1,
              op, ": query_start_loc [num_seqs + 1] and state_indices [num_seqs] int64");
  TORCH_CHECK(!has_initial_state ||
                  (has_initial_state->scalar_type() == at::kBool &&
                   has_initial_state->is_contiguous() &&
                   has_initial_state->size(0) == state_indices.size(0)),
              op, ": has_initial_state must be bool [num_seqs]");
  const int64_t* slots = state_indices.data_ptr<int64_t>();
  for (int64_t s = 0; s < state_indices.size(0); ++s) {
    TORCH_CHECK(slots[s] >= 0 && slots[s] < num_slots, op, ": slot ", slots[s],
                " outside the pool of ", num_slots);
  }
}

// The state pool is fp32 [num_slots, heads, rows, cols] with contiguous [rows, cols] states.
inline void check_state_pool(const char* op, const at::Tensor& state_pool, int64_t heads,
                             int64_t rows, int64_t cols, const char* layout) {
  TORCH_CHECK(state_pool.scalar_type() == at::kFloat && state_pool.dim() == 4 &&
                  state_pool.size(1) == heads && state_pool.size(2) == rows &&
                  state_pool.size(3) == cols && state_pool.stride(3) == 1 &&
                  state_pool.stride(2) == cols,
              op, ": state_pool must be fp32 [num_slots, ", layout,
              "] with contiguous states, got ", state_pool.sizes());
}

// The slots of a call's sequences in the pool: a head's state, zeroed first where the sequence
// has no initial state.
struct SlotStates {
  float* pool;
  int64_t stride_slot, stride_head, size;
  const int64_t* slots;
  const bool* has_initial;

  SlotStates(at::Tensor& state_pool, const at::Tensor& state_indices,
             const std::optional<at::Tensor>& has_initial_state)
      : pool(state_pool.data_ptr<float>()),
        stride_slot(state_pool.stride(0)),
        stride_head(state_pool.stride(1)),
        size(state_pool.size(2) * state_pool.size(3)),
        slots(state_indices.data_ptr<int64_t>()),
        has_initial(has_initial_state ? has_initial_state->data_ptr<bool>() : nullptr) {}

  float* open(int64_t seq, int64_t head) const {
    float* S = pool + slots[seq] * stride_slot + head * stride_head;
    if (has_initial && !has_initial[seq]) std::fill(S, S + size, 0.f);
    return S;
  }
};

// body(seq, head, scratch) for every (sequence with tokens, head): threads take items from a
// shared counter, longest sequence first, so one long prompt does not leave the other threads
// idle. scratch holds scratch_floats floats per thread.
template <typename Body>
void for_each_sequence_head(const int64_t* starts, int64_t num_seqs, int64_t num_heads,
                            int64_t scratch_floats, const Body& body) {
  struct Item {
    int64_t seq, head, len;
  };
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
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scratch(scratch_floats);
    for (int64_t n = next.fetch_add(1); n < num_items; n = next.fetch_add(1))
      body(items[n].seq, items[n].head, scratch.data());
  });
}

// q, k, v and out of a delta rule: one dtype, out shaped like v, unit stride in the last dim.
inline void check_qkv(const char* op, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& v, const at::Tensor& out) {
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1,
              op, ": q, k, v and out need unit stride in their last dim");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  q.scalar_type() == out.scalar_type() && out.sizes() == v.sizes(),
              op, ": q, k, v and out must share a dtype (out shaped like v)");
}

// q and k of one token and head as fp32, normalised (q scaled) or q only scaled.
template <typename T>
inline void load_qk(const T* q, const T* k, float* qf, float* kf, int64_t K, bool use_qk_l2norm,
                    float scale) {
  load_float(q, qf, K);
  load_float(k, kf, K);
  if (use_qk_l2norm) {
    l2normalise(qf, K, scale);
    l2normalise(kf, K, 1.f);
  } else {
    for (int64_t i = 0; i < K; ++i) qf[i] *= scale;
  }
}

// One token of the delta rule on one head's state S [K, V] in place, two passes over the state:
//   pass 1: S[i] *= decay[i]; kv = k^T S          pass 2: S += k delta^T; o = q^T S
// with delta = beta (v - kv). kv and o are V floats of scratch.
template <typename T>
inline void delta_rule_token(float* __restrict__ S, const float* __restrict__ qf,
                             const float* __restrict__ kf, const float* __restrict__ decay,
                             const T* vt, float beta, int64_t K, int64_t V, float* __restrict__ kv,
                             float* __restrict__ o, T* ot) {
  std::fill(kv, kv + V, 0.f);
  for (int64_t i = 0; i < K; ++i) {
    float* __restrict__ row = S + i * V;
    const float ki = kf[i], di = decay[i];
    for (int64_t j = 0; j < V; ++j) {
      row[j] *= di;
      kv[j] += ki * row[j];
    }
  }
  for (int64_t j = 0; j < V; ++j) kv[j] = beta * (static_cast<float>(vt[j]) - kv[j]);
  std::fill(o, o + V, 0.f);
  for (int64_t i = 0; i < K; ++i) {
    float* __restrict__ row = S + i * V;
    const float ki = kf[i], qi = qf[i];
    for (int64_t j = 0; j < V; ++j) {
      row[j] += ki * kv[j];
      o[j] += qi * row[j];
    }
  }
  for (int64_t j = 0; j < V; ++j) ot[j] = static_cast<T>(o[j]);
}

// Both delta rules over a varlen batch, the state in place: one work item per (sequence, value
// head), key head h / (num_v_heads / num_k_heads). g is fp32 [num_tokens, num_v_heads] (one
// decay per head: the gated delta rule) or, with per_channel_decay, [num_tokens, num_heads,
// k_dim] (Kimi Delta Attention); beta fp32 [num_tokens, num_v_heads]. Arguments checked.
template <typename T>
void run_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& g, const at::Tensor& beta, at::Tensor& state_pool,
                    const at::Tensor& query_start_loc, const at::Tensor& state_indices,
                    const std::optional<at::Tensor>& has_initial_state, bool use_qk_l2norm,
                    double scale, at::Tensor& out, bool per_channel_decay) {
  const int64_t num_k_heads = q.size(1), K = q.size(2);
  const int64_t num_v_heads = v.size(1), V = v.size(2);
  const int64_t ratio = num_v_heads / num_k_heads;
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const SlotStates states(state_pool, state_indices, has_initial_state);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float* gp = g.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t gs0 = g.stride(0), gs1 = g.stride(1), bs0 = beta.stride(0);
  const float fscale = static_cast<float>(scale);

  for_each_sequence_head(
      starts, state_indices.size(0), num_v_heads, 3 * K + 2 * V,
      [&](int64_t seq, int64_t h, float* buf) {
        float* __restrict__ qf = buf;
        float* __restrict__ kf = qf + K;
        float* __restrict__ decay = kf + K;  // per key channel, or one factor spread over K
        float* __restrict__ kv = decay + K;
        float* __restrict__ o = kv + V;
        const int64_t hk = h / ratio;
        float* __restrict__ S = states.open(seq, h);
        for (int64_t t = starts[seq]; t < starts[seq + 1]; ++t) {
          load_qk(qp + t * qs0 + hk * qs1, kp + t * ks0 + hk * ks1, qf, kf, K, use_qk_l2norm,
                  fscale);
          const float* gt = gp + t * gs0 + h * gs1;
          if (per_channel_decay) {
            for (int64_t i = 0; i < K; ++i) decay[i] = std::exp(gt[i]);
          } else {
            std::fill(decay, decay + K, std::exp(gt[0]));
          }
          delta_rule_token(S, qf, kf, decay, vp + t * vs0 + h * vs1, bp[t * bs0 + h], K, V, kv, o,
                           op + t * os0 + h * os1);
        }
      });
}

// run_delta_rule for fp32 or bf16 q, k, v and out.
inline void delta_rule(const char* op, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                       at::Tensor& state_pool, const at::Tensor& query_start_loc,
                       const at::Tensor& state_indices,
                       const std::optional<at::Tensor>& has_initial_state, bool use_qk_l2norm,
                       double scale, at::Tensor& out, bool per_channel_decay) {
  if (q.scalar_type() == at::kFloat) {
    run_delta_rule<float>(q, k, v, g, beta, state_pool, query_start_loc, state_indices,
                          has_initial_state, use_qk_l2norm, scale, out, per_channel_decay);
  } else if (q.scalar_type() == at::kBFloat16) {
    run_delta_rule<c10::BFloat16>(q, k, v, g, beta, state_pool, query_start_loc, state_indices,
                                  has_initial_state, use_qk_l2norm, scale, out,
                                  per_channel_decay);
  } else {
    TORCH_CHECK(false, op, ": q, k, v and out must be fp32 or bf16, got ", q.scalar_type());
  }
}

}  // namespace pagedq_recurrent
