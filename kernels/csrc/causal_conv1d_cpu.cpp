// The causal depthwise convolution of Gated DeltaNet for CPUs, registered as
// pagedq::causal_conv1d: the twin of kernels/causal_conv1d.py (varlen, a conv state slot per
// sequence; a decode step is a batch of one-token sequences).
//
// Work items are (sequence, block of 64 channels). An item keeps the last kernel_size - 1 inputs
// of its channels in a small window (starting from the slot's state), walks its tokens in order
// with the channels innermost (contiguous in x, so the loop vectorises), and writes the window
// back to the slot at the end. The sum is fp32, rounded to the input dtype before SiLU and again
// after it, as transformers' Qwen3.5 does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "recurrent_cpu.h"

namespace {

constexpr int64_t kChannels = 64;

template <typename T>
void run(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
         at::Tensor& pool, const at::Tensor& query_start_loc, const at::Tensor& state_indices,
         const std::optional<at::Tensor>& has_initial_state, bool silu, at::Tensor& out) {
  const int64_t num_seqs = state_indices.size(0), dim = x.size(1), width = weight.size(1) - 1;
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const int64_t* slots = state_indices.data_ptr<int64_t>();
  const bool* has_initial = has_initial_state ? has_initial_state->data_ptr<bool>() : nullptr;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* pp = pool.data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  const int64_t ps0 = pool.stride(0), ps1 = pool.stride(1), ps2 = pool.stride(2);
  // weight transposed to [kernel_size][dim] fp32 and the bias as fp32, once per call.
  std::vector<float> wt((width + 1) * dim), b(dim, 0.f);
  const T* wp = weight.data_ptr<T>();
  for (int64_t c = 0; c < dim; ++c)
    for (int64_t j = 0; j <= width; ++j)
      wt[j * dim + c] = static_cast<float>(wp[c * weight.stride(0) + j * weight.stride(1)]);
  if (bias) {
    const T* bsrc = bias->data_ptr<T>();
    for (int64_t c = 0; c < dim; ++c) b[c] = static_cast<float>(bsrc[c * bias->stride(0)]);
  }
  const int64_t blocks = (dim + kChannels - 1) / kChannels;

  at::parallel_for(0, num_seqs * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> window(width * kChannels);
    float acc[kChannels];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / blocks, c0 = (item % blocks) * kChannels;
      const int64_t nc = std::min(kChannels, dim - c0);
      if (starts[s + 1] == starts[s]) continue;
      T* state = pp + slots[s] * ps0 + c0 * ps1;
      const bool zero = has_initial && !has_initial[s];
      for (int64_t j = 0; j < width; ++j)
        for (int64_t c = 0; c < nc; ++c)
          window[j * kChannels + c] = zero ? 0.f : static_cast<float>(state[c * ps1 + j * ps2]);
      for (int64_t t = starts[s]; t < starts[s + 1]; ++t) {
        const T* xt = xp + t * xs + c0;
        for (int64_t c = 0; c < nc; ++c) acc[c] = b[c0 + c];
        for (int64_t j = 0; j < width; ++j) {
          const float* w = wt.data() + j * dim + c0;
          const float* win = window.data() + j * kChannels;
          for (int64_t c = 0; c < nc; ++c) acc[c] += w[c] * win[c];
        }
        const float* wlast = wt.data() + width * dim + c0;
        T* ot = op + t * os + c0;
        for (int64_t c = 0; c < nc; ++c) {
          const float xin = static_cast<float>(xt[c]);
          float y = static_cast<float>(static_cast<T>(acc[c] + wlast[c] * xin));
          if (silu) y = y / (1.f + std::exp(-y));
          ot[c] = static_cast<T>(y);
        }
        // Slide the window by one token: its oldest input leaves, this token's enters.
        for (int64_t j = 0; j + 1 < width; ++j)
          for (int64_t c = 0; c < nc; ++c)
            window[j * kChannels + c] = window[(j + 1) * kChannels + c];
        if (width > 0)
          for (int64_t c = 0; c < nc; ++c)
            window[(width - 1) * kChannels + c] = static_cast<float>(xt[c]);
      }
      for (int64_t j = 0; j < width; ++j)
        for (int64_t c = 0; c < nc; ++c)
          state[c * ps1 + j * ps2] = static_cast<T>(window[j * kChannels + c]);
    }
  });
}

void causal_conv1d(const at::Tensor& x, const at::Tensor& weight,
                   const std::optional<at::Tensor>& bias, at::Tensor& conv_state_pool,
                   const at::Tensor& query_start_loc, const at::Tensor& state_indices,
                   const std::optional<at::Tensor>& has_initial_state, bool silu, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.sizes() == x.sizes() && out.stride(1) == 1,
              "causal_conv1d: x and out must be [num_tokens, dim] with unit stride, got ",
              x.sizes(), " and ", out.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == x.size(1) && weight.size(1) >= 1,
              "causal_conv1d: weight must be [dim, kernel_size], got ", weight.sizes());
  TORCH_CHECK(conv_state_pool.dim() == 3 && conv_state_pool.size(1) == x.size(1) &&
                  conv_state_pool.size(2) == weight.size(1) - 1,
              "causal_conv1d: conv_state_pool must be [num_slots, dim, kernel_size - 1], got ",
              conv_state_pool.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(weight.scalar_type() == dtype && conv_state_pool.scalar_type() == dtype &&
                  out.scalar_type() == dtype && (!bias || bias->scalar_type() == dtype),
              "causal_conv1d: x, weight, bias, conv_state_pool and out must share a dtype");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == x.size(1)),
              "causal_conv1d: bias must be [dim]");
  pagedq_recurrent::check_slots("causal_conv1d", query_start_loc, state_indices,
                                has_initial_state, conv_state_pool.size(0));
  AT_DISPATCH_SWITCH(dtype, "causal_conv1d",
                     AT_DISPATCH_CASE(at::kFloat, [&] {
                       run<float>(x, weight, bias, conv_state_pool, query_start_loc,
                                  state_indices, has_initial_state, silu, out);
                     }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       run<c10::BFloat16>(x, weight, bias, conv_state_pool, query_start_loc,
                                          state_indices, has_initial_state, silu, out);
                     }));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedq, m) {
  m.def(
      "causal_conv1d(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_state_pool, "
      "Tensor query_start_loc, Tensor state_indices, Tensor? has_initial_state, bool silu, "
      "Tensor(b!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pagedq, CPU, m) { m.impl("causal_conv1d", &causal_conv1d); }
