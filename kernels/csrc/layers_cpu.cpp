// RMSNorm (optionally fused with the residual add), SiLU-and-mul, rotary embedding and the
// greedy sampler's argmax for the CPU, registered as torch ops pagedq::*. Each is one pass over
// the rows instead of the 4-8 elementwise torch ops of the reference (kernels/reference.py), and
// computes what the reference computes: fp32 inside, rounded to the model dtype where Hugging
// Face rounds.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
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

// Rows per task of these element-wise ops: at least kGrainElems values, so that a decode step's
// few rows (32 x 1024) run on the calling thread. Each parallel region waits until every thread
// is scheduled, which on a loaded host is a time slice (about 1 ms a region measured there),
// against the few microseconds such a pass saves on two threads.
constexpr int64_t kGrainElems = int64_t(1) << 16;
inline int64_t grain_rows(int64_t row_elems, int64_t floor_rows) {
  return std::max(floor_rows, kGrainElems / std::max<int64_t>(1, row_elems));
}

// out = round(w * (h / rms(h))): the norm and its scale in fp32, rounded once. The weight is
// fp32 (a bf16 model's norms keep theirs fp32: Gemma's 1 + w is not a bf16 number) or x's
// dtype. Hugging Face's Llama rounds h / rms(h) to the model dtype before the scale: in bf16 a
// second rounding that fp32 does not make. The residual stream R is x's dtype or fp32 (a bf16
// model's stream kept in fp32: its sums are not rounded to bf16 layer after layer).
template <typename T, typename W, typename R>
void rms_norm_rows(const T* x, int64_t x_stride, R* residual, int64_t r_stride, const W* weight,
                   float eps, T* out, int64_t o_stride, int64_t rows, int64_t hidden) {
  at::parallel_for(0, rows, grain_rows(hidden, 16), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* xr = x + t * x_stride;
      R* res = residual ? residual + t * r_stride : nullptr;
      T* o = out + t * o_stride;
      vfloat sq = {};
      int64_t i = 0;
      for (; i + kLanes <= hidden; i += kLanes) {
        vfloat h = load_as_float(xr + i);
        if (res) {  // residual = x + residual, in the stream's dtype
          h = round_to(res, h + load_as_float(res + i));
          store_from_float(res + i, h);
        }
        sq += h * h;
      }
      float sum = sum_lanes(sq);
      for (; i < hidden; ++i) {
        float h = static_cast<float>(xr[i]);
        if (res) {
          h = static_cast<float>(static_cast<R>(h + static_cast<float>(res[i])));
          res[i] = static_cast<R>(h);
        }
        sum += h * h;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
      for (i = 0; i + kLanes <= hidden; i += kLanes) {
        const vfloat h = res ? load_as_float(res + i) : load_as_float(xr + i);
        store_from_float(o + i, load_as_float(weight + i) * (h * inv));
      }
      for (; i < hidden; ++i) {
        const float h = res ? static_cast<float>(res[i]) : static_cast<float>(xr[i]);
        o[i] = static_cast<T>(static_cast<float>(weight[i]) * (h * inv));
      }
    }
  });
}

// Runs `run(T{}, W{}, R{})` for the dtypes of x (and out), the weight and the residual stream:
// x fp32 or bf16; the weight and the stream each fp32 or x's dtype.
template <typename F>
void dispatch_norm(const char* op, const at::Tensor& x, const at::Tensor& weight,
                   at::ScalarType stream, F&& run) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == dtype, op,
              ": the weight must be float32 or x's dtype, got ", weight.scalar_type());
  TORCH_CHECK(stream == at::kFloat || stream == dtype, op,
              ": the residual must be float32 or x's dtype, got ", stream);
  if (dtype == at::kFloat) {
    run(float{}, float{}, float{});
    return;
  }
  TORCH_CHECK(dtype == at::kBFloat16, op, ": dtype ", dtype, " is not supported");
  using B = c10::BFloat16;
  const bool w32 = weight.scalar_type() == at::kFloat, r32 = stream == at::kFloat;
  if (w32 && r32) {
    run(B{}, float{}, float{});
  } else if (w32) {
    run(B{}, float{}, B{});
  } else if (r32) {
    run(B{}, B{}, float{});
  } else {
    run(B{}, B{}, B{});
  }
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, hidden] with unit stride");
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes() && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm: x ", x.sizes(), ", weight ", weight.sizes(), ", out ", out.sizes());
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "rms_norm: x and out must share a dtype");
  dispatch_norm("rms_norm", x, weight, x.scalar_type(), [&](auto t, auto w, auto) {
    using T = decltype(t);
    using W = decltype(w);
    rms_norm_rows<T, W, T>(x.data_ptr<T>(), x.stride(0), nullptr, 0, weight.data_ptr<W>(), eps,
                           out.data_ptr<T>(), out.stride(0), x.size(0), x.size(1));
  });
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
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "fused_add_rms_norm: x and out must share a dtype");
  dispatch_norm("fused_add_rms_norm", x, weight, residual.scalar_type(), [&](auto t, auto w, auto r) {
    using T = decltype(t);
    using W = decltype(w);
    using R = decltype(r);
    rms_norm_rows<T, W, R>(x.data_ptr<T>(), x.stride(0), residual.data_ptr<R>(), residual.stride(0),
                           weight.data_ptr<W>(), eps, out.data_ptr<T>(), out.stride(0), x.size(0),
                           x.size(1));
  });
}

template <typename T>
void silu_and_mul_rows(const T* x, int64_t x_stride, T* out, int64_t o_stride, int64_t rows,
                       int64_t d) {
  at::parallel_for(0, rows, grain_rows(2 * d, 4), [&](int64_t begin, int64_t end) {
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

// Keeps a product as its own rounded value: without it GCC contracts a * b + c * d into an FMA,
// which rounds once where the reference (and Hugging Face) rounds twice.
template <typename V>
inline V no_contract(V v) {
  asm("" : "+v"(v));
  return v;
}

// x[t, h] = x[t, h] * cos[t] + roll(x[t, h], D/2) * signed_sin[t], in place, as
// rotary_apply_torch (kernels/reference.py) computes it: each product rounded to the model
// dtype, then the sum.
// The two halves of a row are read before either is written, so in place is safe.
template <typename T>
void rotary_rows(T* x, int64_t x_st, int64_t x_sh, const T* cos, const T* sin, int64_t cs_st,
                 int64_t tokens, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens * heads, grain_rows(dim, 16), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row / heads;
      T* a = x + t * x_st + (row % heads) * x_sh;  // first half; the second is at a + half
      const T* c = cos + t * cs_st;
      const T* s = sin + t * cs_st;
      int64_t i = 0;
      for (; i + kLanes <= half; i += kLanes) {
        const vfloat x1 = load_as_float(a + i), x2 = load_as_float(a + half + i);
        const vfloat o1 = round_to(a, no_contract(x1 * load_as_float(c + i))) +
                          round_to(a, no_contract(x2 * load_as_float(s + i)));
        const vfloat o2 = round_to(a, no_contract(x2 * load_as_float(c + half + i))) +
                          round_to(a, no_contract(x1 * load_as_float(s + half + i)));
        store_from_float(a + i, o1);
        store_from_float(a + half + i, o2);
      }
      for (; i < half; ++i) {
        const float x1 = static_cast<float>(a[i]), x2 = static_cast<float>(a[half + i]);
        const float p1 = static_cast<float>(static_cast<T>(no_contract(x1 * static_cast<float>(c[i]))));
        const float q1 = static_cast<float>(static_cast<T>(no_contract(x2 * static_cast<float>(s[i]))));
        const float p2 =
            static_cast<float>(static_cast<T>(no_contract(x2 * static_cast<float>(c[half + i]))));
        const float q2 =
            static_cast<float>(static_cast<T>(no_contract(x1 * static_cast<float>(s[half + i]))));
        a[i] = static_cast<T>(p1 + q1);
        a[half + i] = static_cast<T>(p2 + q2);
      }
    }
  });
}

// Rotates x [tokens, heads, dim] (rows contiguous, e.g. the q and k heads of a QKV output) in
// place by cos and signed_sin [tokens, 1, dim] of RotaryEmbedding.cos_sin.
void rotary(at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary: x must be [tokens, heads, dim] with contiguous rows and even dim, got ",
              x.sizes(), " strides ", x.strides());
  TORCH_CHECK(cos.sizes() == signed_sin.sizes() && cos.strides() == signed_sin.strides() &&
                  cos.size(0) == x.size(0) && cos.size(-1) == x.size(2) && cos.stride(-1) == 1 &&
                  cos.scalar_type() == x.scalar_type() &&
                  signed_sin.scalar_type() == x.scalar_type(),
              "rotary: cos and signed_sin must be [tokens, 1, dim] of x's dtype, got ",
              cos.sizes(), " and ", signed_sin.sizes(), " for x ", x.sizes());
  AT_DISPATCH_SWITCH(x.scalar_type(), "rotary",
                     AT_DISPATCH_CASE(at::kFloat, [&] {
                       rotary_rows<float>(x.data_ptr<float>(), x.stride(0), x.stride(1),
                                          cos.data_ptr<float>(), signed_sin.data_ptr<float>(),
                                          cos.stride(0), x.size(0), x.size(1), x.size(2));
                     }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       using T = c10::BFloat16;
                       rotary_rows<T>(x.data_ptr<T>(), x.stride(0), x.stride(1),
                                      cos.data_ptr<T>(), signed_sin.data_ptr<T>(), cos.stride(0),
                                      x.size(0), x.size(1), x.size(2));
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

// logits[rows[i], j] = -inf wherever bit j of mask[i] is clear (bit j % 32 of int32 word
// j / 32; columns past the mask's words are forbidden too): a grammar's token bitmask applied in
// one pass. Most words of a JSON grammar's mask are all clear or all set; the torch form
// (unpack to a bool [rows, vocab], invert, masked_fill) took 3.6-4.4 ms for 32 rows of a
// 49,152-token vocabulary, a tenth of a bf16 decode step; this pass 0.14-0.25 ms.
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& mask) {
  check_rows(logits, "logits");
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "apply_token_bitmask: logits must be float32");
  TORCH_CHECK(mask.scalar_type() == at::kInt && mask.dim() == 2 && mask.is_contiguous(),
              "apply_token_bitmask: mask must be contiguous int32 [rows, words]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() &&
                  rows.size(0) == mask.size(0),
              "apply_token_bitmask: rows must be int64 [mask rows]");
  const int64_t vocab = logits.size(1), words = mask.size(1), stride = logits.stride(0);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < logits.size(0), "apply_token_bitmask: row ",
                row_ids[i], " is out of range");
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float* base = logits.data_ptr<float>();
  const int32_t* bits = mask.data_ptr<int32_t>();
  at::parallel_for(0, rows.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* p = base + row_ids[i] * stride;
      const uint32_t* m = reinterpret_cast<const uint32_t*>(bits + i * words);
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t word = w < words ? m[w] : 0u;
        if (word == 0xFFFFFFFFu) continue;
        const int64_t j0 = w * 32, j1 = std::min(vocab, j0 + 32);
        if (word == 0u) {
          std::fill(p + j0, p + j1, neg_inf);
          continue;
        }
        for (int64_t j = j0; j < j1; ++j)
          if (!((word >> (j - j0)) & 1u)) p[j] = neg_inf;
      }
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
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor rows, Tensor mask) -> ()");
  m.def("rotary(Tensor(a!) x, Tensor cos, Tensor signed_sin) -> ()");
}

TORCH_LIBRARY_IMPL(pagedq, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("apply_token_bitmask", &apply_token_bitmask);
  m.impl("rotary", &rotary);
}
