// RMSNorm (optionally fused with the residual add), SiLU-and-mul and the greedy sampler's argmax
// for the CPU, registered as torch ops pagedq::*. Each is one pass over the rows instead of the 5-8 elementwise torch ops of
// the reference (kernels/reference.py), and computes what the reference computes: fp32 inside,
// rounded to the model dtype where Hugging Face rounds.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "vec_cpu.h"

namespace {

using namespace pagedq_vec;

inline vfloat load_as_float(const float* p) { return loadv(p); }
inline vfloat load_as_float(const c10::BFloat16* p) {
  return widen_bf16(reinterpret_cast<const uint16_t*>(p));
}
inline void store_from_float(float* p, vfloat v) { storev(p, v); }
inline void store_from_float(c10::BFloat16* p, vfloat v) {
  narrow_bf16(reinterpret_cast<uint16_t*>(p), v);
}
// Rounds to the storage type and back (the reference rounds its intermediates there).
inline vfloat round_to(float*, vfloat v) { return v; }
inline vfloat round_to(c10::BFloat16*, vfloat v) {
  alignas(64) uint16_t tmp[kLanes];
  narrow_bf16(tmp, v);
  return widen_bf16(tmp);
}

template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, T* residual, int64_t r_stride, const T* weight,
                   float eps, T* out, int64_t o_stride, int64_t rows, int64_t hidden) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* xr = x + t * x_stride;
      T* res = residual ? residual + t * r_stride : nullptr;
      T* o = out + t * o_stride;
      vfloat sq = {};
      int64_t i = 0;
      for (; i + kLanes <= hidden; i += kLanes) {
        vfloat h = load_as_float(xr + i);
        if (res) {  // residual = x + residual, in the model dtype
          h = round_to(res, h + load_as_float(res + i));
          store_from_float(res + i, h);
        }
        sq += h * h;
      }
      float sum = sum_lanes(sq);
      for (; i < hidden; ++i) {
        float h = static_cast<float>(xr[i]);
        if (res) {
          h = static_cast<float>(static_cast<T>(h + static_cast<float>(res[i])));
          res[i] = static_cast<T>(h);
        }
        sum += h * h;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
      const T* src = res ? res : xr;
      for (i = 0; i + kLanes <= hidden; i += kLanes) {
        const vfloat y = round_to(o, load_as_float(src + i) * inv);
        store_from_float(o + i, load_as_float(weight + i) * y);
      }
      for (; i < hidden; ++i) {
        const float y = static_cast<float>(static_cast<T>(static_cast<float>(src[i]) * inv));
        o[i] = static_cast<T>(static_cast<float>(weight[i]) * y);
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, hidden] with unit stride");
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes() && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm: x ", x.sizes(), ", weight ", weight.sizes(), ", out ", out.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && x.scalar_type() == out.scalar_type(),
              "rms_norm: x, weight and out must share a dtype");
  AT_DISPATCH_SWITCH(x.scalar_type(), "rms_norm",
                     AT_DISPATCH_CASE(at::kFloat, [&] {
                       rms_norm_rows<float>(x.data_ptr<float>(), x.stride(0), nullptr, 0,
                                            weight.data_ptr<float>(), eps, out.data_ptr<float>(),
                                            out.stride(0), x.size(0), x.size(1));
                     }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       using T = c10::BFloat16;
                       rms_norm_rows<T>(x.data_ptr<T>(), x.stride(0), nullptr, 0,
                                        weight.data_ptr<T>(), eps, out.data_ptr<T>(),
                                        out.stride(0), x.size(0), x.size(1));
                     }));
}

// residual = x + residual; out = rms_norm(residual) * weight.
void fused_add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps, at::Tensor& out) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  check_rows(out, "out");
  TORCH_CHECK(residual.sizes() == x.sizes() && out.sizes() == x.sizes() &&
                  weight.is_contiguous() && weight.numel() == x.size(1),
              "fused_add_rms_norm: x ", x.sizes(), ", residual ", residual.sizes(), ", weight ",
              weight.sizes());
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type() &&
                  x.scalar_type() == out.scalar_type(),
              "fused_add_rms_norm: all tensors must share a dtype");
  AT_DISPATCH_SWITCH(x.scalar_type(), "fused_add_rms_norm",
                     AT_DISPATCH_CASE(at::kFloat, [&] {
                       rms_norm_rows<float>(x.data_ptr<float>(), x.stride(0),
                                            residual.data_ptr<float>(), residual.stride(0),
                                            weight.data_ptr<float>(), eps, out.data_ptr<float>(),
                                            out.stride(0), x.size(0), x.size(1));
                     }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       using T = c10::BFloat16;
                       rms_norm_rows<T>(x.data_ptr<T>(), x.stride(0), residual.data_ptr<T>(),
                                        residual.stride(0), weight.data_ptr<T>(), eps,
                                        out.data_ptr<T>(), out.stride(0), x.size(0), x.size(1));
                     }));
}

template <typename T>
void silu_and_mul_rows(const T* x, int64_t x_stride, T* out, int64_t o_stride, int64_t rows,
                       int64_t d) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = x + t * x_stride;
      const T* up = gate + d;
      T* o = out + t * o_stride;
      int64_t i = 0;
      for (; i + kLanes <= d; i += kLanes) {
        const vfloat g = load_as_float(gate + i);
        const vfloat silu = round_to(o, g / (1.f + exp_v(-g)));
        store_from_float(o + i, silu * load_as_float(up + i));
      }
      for (; i < d; ++i) {
        const float g = static_cast<float>(gate[i]);
        const float silu = static_cast<float>(static_cast<T>(g / (1.f + std::exp(-g))));
        o[i] = static_cast<T>(silu * static_cast<float>(up[i]));
      }
    }
  });
}

// out = silu(x[:, :d]) * x[:, d:], x being [rows, 2d].
void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  check_rows(x, "x");
  check_rows(out, "out");
  const int64_t d = x.size(1) / 2;
  TORCH_CHECK(x.size(1) == 2 * d && out.size(0) == x.size(0) && out.size(1) == d &&
                  out.scalar_type() == x.scalar_type(),
              "silu_and_mul: x ", x.sizes(), " must be [rows, 2d] and out [rows, d] of its dtype");
  AT_DISPATCH_SWITCH(x.scalar_type(), "silu_and_mul",
                     AT_DISPATCH_CASE(at::kFloat, [&] {
                       silu_and_mul_rows<float>(x.data_ptr<float>(), x.stride(0),
                                                out.data_ptr<float>(), out.stride(0), x.size(0),
                                                d);
                     }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       using T = c10::BFloat16;
                       silu_and_mul_rows<T>(x.data_ptr<T>(), x.stride(0), out.data_ptr<T>(),
                                            out.stride(0), x.size(0), d);
                     }));
}

// out[r] = torch.argmax(x[r]): the first index of the row's largest value, or of its first NaN
// (torch ranks NaN above everything). Rows run in parallel; aten's reduction over the last dim
// ran on one thread, 9.6 ms for the [64, 49152] logits of a decode step.
void argmax_rows(at::Tensor& out, const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kLong &&
                  out.dim() == 1 && out.size(0) == x.size(0) && out.is_contiguous(),
              "argmax_rows: x must be float32 [rows, n] and out int64 [rows], got ", x.sizes(),
              " ", x.scalar_type(), " and ", out.sizes(), " ", out.scalar_type());
  const int64_t n = x.size(1), stride = x.stride(0);
  TORCH_CHECK(n > 0, "argmax_rows: rows must not be empty");
  const float* base = x.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* p = base + r * stride;
      vfloat mx = vfloat{} - std::numeric_limits<float>::infinity();
      vint nan = {};
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) {
        const vfloat v = loadv(p + i);
        nan |= v != v;
        mx = v > mx ? v : mx;
      }
      float m = -std::numeric_limits<float>::infinity();
      bool has_nan = false;
      for (int j = 0; j < kLanes; ++j) {
        m = std::max(m, mx[j]);
        has_nan |= nan[j] != 0;
      }
      for (; i < n; ++i) {
        has_nan |= std::isnan(p[i]);
        m = std::max(m, p[i]);
      }
      int64_t k = 0;
      if (has_nan) {
        while (!std::isnan(p[k])) ++k;
      } else {
        while (p[k] != m) ++k;
      }
      dst[r] = k;
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedq, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.def(
      "fused_add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps, "
      "Tensor(b!) out) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("argmax_rows(Tensor(a!) out, Tensor x) -> ()");
}

TORCH_LIBRARY_IMPL(pagedq, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
}
