// The Mamba-2 selective state-space scan (SSD) for CPUs, registered as pagedq::mamba_chunk_scan:
// the twin of kernels/mamba_ssm.py over a varlen batch with a state slot per sequence.
//
// One work item is (sequence, head) (recurrent_cpu.h's work loop, longest first). An item walks
// its tokens in order on the slot's fp32 state [head_dim, state_dim] in place, one pass over the
// state per token:
//   d = clamp(softplus(dt + dt_bias));  S[p] = exp(d A) S[p] + d x[p] B;  y[p] = S[p] . C + D x[p]
// (each row of S is updated and read back while in registers). Mamba-1's selective scan is the
// same walk with A [H, N], a decay exp(d A[n]) per state dimension (head_dim 1, one group).
// This is the recurrent form for
// every sequence, prefill chunks included: it reads and writes the state once per token, and
// one head's state (32 KiB at 64 x 128) stays in L1/L2 between tokens.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

#include "recurrent_cpu.h"
#include "vec_cpu.h"

namespace {

namespace rec = pagedq_recurrent;

using pagedq_vec::kLanes;
using pagedq_vec::loadv;
using pagedq_vec::storev;
using pagedq_vec::vfloat;

// torch's softplus (beta 1, threshold 20): x itself above 20, where log1p(e^x) == x in fp32.
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

// The decay of state dimensions [n, n + lanes): one per head, or one per dimension.
template <bool kPerState>
inline vfloat decay_at(const float* decay, int64_t n) {
  if constexpr (kPerState) {
    return loadv(decay + n);
  } else {
    return vfloat{} + decay[0];
  }
}

// One token of one head: S [P, N] advanced in place, y [P] = S C + D x; decay holds N factors
// (kPerState) or one.
template <bool kPerState>
inline void step(float* __restrict__ S, const float* __restrict__ xf, const float* __restrict__ Bf,
                 const float* __restrict__ Cf, float d, const float* __restrict__ decay, float Dh,
                 int64_t P, int64_t N, float* __restrict__ y) {
  for (int64_t p = 0; p < P; ++p) {
    float* __restrict__ row = S + p * N;
    const float dx = d * xf[p];
    vfloat acc = {};
    int64_t n = 0;
    for (; n + kLanes <= N; n += kLanes) {
      const vfloat s = loadv(row + n) * decay_at<kPerState>(decay, n) + loadv(Bf + n) * dx;
      storev(row + n, s);
      acc += s * loadv(Cf + n);
    }
    float sum = pagedq_vec::sum_lanes(acc);
    for (; n < N; ++n) {
      const float s = row[n] * decay[kPerState ? n : 0] + Bf[n] * dx;
      row[n] = s;
      sum += s * Cf[n];
    }
    y[p] = sum + Dh * xf[p];
  }
}

template <typename T, typename O>
void run(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
         const at::Tensor& C, const std::optional<at::Tensor>& D,
         const std::optional<at::Tensor>& dt_bias, at::Tensor& state_pool,
         const at::Tensor& query_start_loc, const at::Tensor& state_indices,
         const std::optional<at::Tensor>& has_initial_state, double dt_min, double dt_max,
         at::Tensor& out) {
  const int64_t H = x.size(1), P = x.size(2);
  const int64_t G = B.size(1), N = B.size(2);
  const int64_t heads_per_group = H / G;
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const rec::SlotStates states(state_pool, state_indices, has_initial_state);
  const T* xp = x.data_ptr<T>();
  const T* bp = B.data_ptr<T>();
  const T* cp = C.data_ptr<T>();
  O* op = out.data_ptr<O>();
  const float* dtp = dt.data_ptr<float>();
  const float* ap = A.data_ptr<float>();
  const float* dp = D ? D->data_ptr<float>() : nullptr;
  const float* biasp = dt_bias ? dt_bias->data_ptr<float>() : nullptr;
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), bs0 = B.stride(0), bs1 = B.stride(1);
  const int64_t cs0 = C.stride(0), cs1 = C.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t dts0 = dt.stride(0);
  const float lo = static_cast<float>(dt_min), hi = static_cast<float>(dt_max);
  const bool per_state = A.dim() == 2;

  rec::for_each_sequence_head(
      starts, state_indices.size(0), H, 2 * P + 3 * N, [&](int64_t seq, int64_t h, float* buf) {
        float* __restrict__ xf = buf;
        float* __restrict__ y = xf + P;
        float* __restrict__ Bf = y + P;
        float* __restrict__ Cf = Bf + N;
        float* __restrict__ decay = Cf + N;
        const int64_t g = h / heads_per_group;
        float* __restrict__ S = states.open(seq, h);
        const float* Ah = ap + (per_state ? h * N : h);
        const float Dh = dp ? dp[h] : 0.f, bias = biasp ? biasp[h] : 0.f;
        for (int64_t t = starts[seq]; t < starts[seq + 1]; ++t) {
          const float d = std::min(std::max(softplus(dtp[t * dts0 + h] + bias), lo), hi);
          rec::load_float(xp + t * xs0 + h * xs1, xf, P);
          rec::load_float(bp + t * bs0 + g * bs1, Bf, N);
          rec::load_float(cp + t * cs0 + g * cs1, Cf, N);
          if (per_state) {
            for (int64_t n = 0; n < N; ++n) decay[n] = std::exp(d * Ah[n]);
            step<true>(S, xf, Bf, Cf, d, decay, Dh, P, N, y);
          } else {
            decay[0] = std::exp(d * Ah[0]);
            step<false>(S, xf, Bf, Cf, d, decay, Dh, P, N, y);
          }
          O* ot = op + t * os0 + h * os1;
          for (int64_t p = 0; p < P; ++p) ot[p] = static_cast<O>(y[p]);
        }
      });
}

void check_head_vector(const std::optional<at::Tensor>& v, int64_t H, const char* name) {
  if (!v) return;
  TORCH_CHECK(v->scalar_type() == at::kFloat && v->dim() == 1 && v->size(0) == H &&
                  v->is_contiguous(),
              "mamba_chunk_scan: ", name, " must be contiguous fp32 [num_heads = ", H, "]");
}

void mamba_chunk_scan(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                      const at::Tensor& B, const at::Tensor& C, const std::optional<at::Tensor>& D,
                      const std::optional<at::Tensor>& dt_bias, at::Tensor& state_pool,
                      const at::Tensor& query_start_loc, const at::Tensor& state_indices,
                      const std::optional<at::Tensor>& has_initial_state, double dt_min,
                      double dt_max, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 3 && B.dim() == 3 && C.sizes() == B.sizes() && B.size(0) == x.size(0),
              "mamba_chunk_scan: x ", x.sizes(), ", B ", B.sizes(), ", C ", C.sizes());
  const int64_t H = x.size(1);
  TORCH_CHECK(B.size(1) > 0 && H % B.size(1) == 0, "mamba_chunk_scan: num_heads ", H,
              " is not a multiple of num_groups ", B.size(1));
  TORCH_CHECK(x.stride(2) == 1 && B.stride(2) == 1 && C.stride(2) == 1 && out.stride(2) == 1,
              "mamba_chunk_scan: x, B, C and out need unit stride in their last dim");
  const bool fp32_out = out.scalar_type() == at::kFloat;
  TORCH_CHECK(x.scalar_type() == B.scalar_type() && x.scalar_type() == C.scalar_type() &&
                  (x.scalar_type() == out.scalar_type() || fp32_out) && out.sizes() == x.sizes(),
              "mamba_chunk_scan: x, B and C must share a dtype, out that dtype or fp32 (shaped "
              "like x)");
  TORCH_CHECK(dt.scalar_type() == at::kFloat && dt.dim() == 2 && dt.size(0) == x.size(0) &&
                  dt.size(1) == H && dt.stride(1) == 1,
              "mamba_chunk_scan: dt must be fp32 [num_tokens, num_heads]");
  TORCH_CHECK(A.scalar_type() == at::kFloat && A.is_contiguous() && A.size(0) == H &&
                  (A.dim() == 1 || (A.dim() == 2 && A.size(1) == B.size(2))),
              "mamba_chunk_scan: A must be contiguous fp32 [num_heads = ", H,
              "] or [num_heads, state_dim]");
  check_head_vector(D, H, "D");
  check_head_vector(dt_bias, H, "dt_bias");
  rec::check_state_pool("mamba_chunk_scan", state_pool, H, x.size(2), B.size(2),
                        "num_heads, head_dim, state_dim");
  rec::check_slots("mamba_chunk_scan", query_start_loc, state_indices, has_initial_state,
                   state_pool.size(0));
  const auto args = std::tie(x, dt, A, B, C, D, dt_bias, state_pool, query_start_loc,
                             state_indices, has_initial_state, dt_min, dt_max, out);
  AT_DISPATCH_SWITCH(x.scalar_type(), "mamba_chunk_scan",
                     AT_DISPATCH_CASE(at::kFloat, [&] { std::apply(run<float, float>, args); })
                         AT_DISPATCH_CASE(at::kBFloat16, [&] {
                           if (fp32_out) {
                             std::apply(run<c10::BFloat16, float>, args);
                           } else {
                             std::apply(run<c10::BFloat16, c10::BFloat16>, args);
                           }
                         }));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedq, m) {
  m.def(
      "mamba_chunk_scan(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, "
      "Tensor? dt_bias, Tensor(a!) state_pool, Tensor query_start_loc, Tensor state_indices, "
      "Tensor? has_initial_state, float dt_min, float dt_max, Tensor(b!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pagedq, CPU, m) { m.impl("mamba_chunk_scan", &mamba_chunk_scan); }
