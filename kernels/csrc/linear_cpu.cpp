// Projections y = x @ W^T + b over weights packed once into this file's layout (AVX-512, AVX2).
//
// oneDNN's prepacked GEMM is at the core's peak when its weights sit in L2, but a decode step
// reads each layer's weights from DRAM once, after the attention has flushed the caches, and
// then oneDNN's blocks wait on their loads: on a Zen 4 host one layer's bf16 projections at
// batch 64 took 1.25x their cache-hot time, and 1.5-3x at batch 1-16 (docs/PERFORMANCE.md).
// Here each thread streams its own column blocks in order and prefetches the next block into
// L2 while the first rows of the current one are computed, so that DRAM and the FMAs overlap.
//
// The layout and the micro-kernels are in gemm_cpu.h (shared with moe_cpu.cpp's grouped expert
// GEMMs). Sums are fp32; a bf16 output is rounded to nearest even once, after the bias, as a
// bf16 GEMM does; an fp32 output of bf16 products (the LM head's logits) keeps the fp32 sums
// unrounded: rounded to bf16, logits 16-32 apart by less than 0.125 tie, and greedy decoding
// then took the lower id where fp32 took the other (bench/fidelity.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

#include "amx_gemm_cpu.h"
#include "gemm_cpu.h"
#include "vec_cpu.h"

namespace {

using namespace pagedq_gemm;

constexpr int64_t kMB = 192;  // rows per pass over the weights: x's block stays in L2
#if defined(PAGEDQ_AMX)
constexpr int64_t kSiluRows = kAmxRows > kMR ? kAmxRows : kMR;  // rows of a fused gate's silu
#else
constexpr int64_t kSiluRows = kMR;
#endif

bool bf16_supported() {
#if defined(PAGEDQ_GEMM_BF16)
  return true;
#else
  return false;
#endif
}

bool fp32_supported() {
#if defined(PAGEDQ_GEMM_FP32)
  return true;
#else
  return false;
#endif
}

bool packed_linear_available(c10::ScalarType dtype) {
  if (dtype == at::kFloat) return fp32_supported();
  if (dtype == at::kBFloat16) return bf16_supported();
  return false;
}

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_linear_weight: weight must be [out, in]");
  // The layout is the same on every host: the expert GEMMs may run where the projections don't.
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "pack_linear_weight: dtype must be float32 or bfloat16, got ", weight.scalar_type());
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), NB = (N + kNR - 1) / kNR;
  if (w.scalar_type() == at::kFloat) {
    at::Tensor out = at::zeros({NB, K, kNR}, w.options());
    const float* src = w.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t nb = b0; nb < b1; ++nb)
        for (int64_t c = 0; c < kNR && nb * kNR + c < N; ++c)
          for (int64_t k = 0; k < K; ++k) dst[(nb * K + k) * kNR + c] = src[(nb * kNR + c) * K + k];
    });
    return out;
  }
  const int64_t K2 = (K + 1) / 2;
  at::Tensor out = at::zeros({NB, K2, kNR, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t c = 0; c < kNR && nb * kNR + c < N; ++c)
        for (int64_t k = 0; k < K; ++k)
          dst[((nb * K2 + k / 2) * kNR + c) * 2 + k % 2] = src[(nb * kNR + c) * K + k];
  });
  return out;
}

// Declared for every target: the dispatch below names it even where only the fallback builds.
// A thread's run of column tasks with its argmax per row: the runs are merged in column order.
struct ArgmaxRun {
  int64_t first_task;
  std::vector<float> best;
  std::vector<int64_t> index;
};

#if defined(PAGEDQ_GEMM_FP32)

// The 4 x 16 outputs of one row: bias added, stored as fp32 (the sums as they are, also of
// bf16 products), or rounded to bf16. `valid` < 64 masks the last block's padding.
// SiLU-and-mul fused in (gate_up's blocks, packed_linear_silu_mul): a gate block's outputs go
// to `silu` (the kMR x 64 rows of the current micro-kernel, as silu_and_mul computes them from
// the gate's rounded values), then the up block of the same columns multiplies them on its way
// out: the [tokens, 2 x intermediate] product is never written.
// kArgmax (packed_linear_argmax): the LM head of a plain greedy batch keeps, per row, the first
// index of its largest logit (or of its first NaN, as torch.argmax) instead of writing the
// [tokens, vocab] fp32 logits for a separate argmax to read back.
enum class Epilogue { kStore, kGate, kUpMul, kArgmax };

struct Output {
  void* base;
  int64_t ld;
  bool fp32_out;
  const float* bias;  // nullptr or this block's 64 values (padded)
  int64_t valid;
  Epilogue epilogue = Epilogue::kStore;
  float* silu = nullptr;  // kSiluRows x 64 per thread (kGate writes it, kUpMul reads it)
  int64_t silu_row0 = 0;  // the row of silu[0]
  float* best = nullptr;  // kArgmax: this thread's best value and index per row (index -1: none)
  int64_t* best_index = nullptr;
};

#if defined(__AVX512F__)

inline void store_row(const Output& o, int64_t row, int64_t col0, const __m512* acc) {
  for (int j = 0; j < 4; ++j) {
    const int64_t left = o.valid - j * 16;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    __m512 v = acc[j];
    if (o.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, o.bias + j * 16));
    if (o.epilogue == Epilogue::kArgmax) {
      float& best = o.best[row];
      int64_t& index = o.best_index[row];
      if (index >= 0 && std::isnan(best)) continue;  // the row's first NaN already won
      const int64_t col = col0 + j * 16;
      const __mmask16 nan = _mm512_mask_cmp_ps_mask(mask, v, v, _CMP_UNORD_Q);
      if (nan) {
        best = std::numeric_limits<float>::quiet_NaN();
        index = col + __builtin_ctz(nan);
        continue;
      }
      const float m = _mm512_mask_reduce_max_ps(mask, v);
      if (index < 0 || m > best) {  // strictly: on a tie the earlier column stays
        best = m;
        index = col + __builtin_ctz(_mm512_mask_cmp_ps_mask(mask, v, _mm512_set1_ps(m), _CMP_EQ_OQ));
      }
      continue;
    }
    if (o.epilogue != Epilogue::kStore) {
      // The gate and up values as a bf16 linear leaves them (rounded), then silu_and_mul's
      // arithmetic (layers_cpu.cpp), so that fused and unfused give the same bits.
      if (!o.fp32_out) v = round_to_bf16(v);
      float* silu = o.silu + (row - o.silu_row0) * kNR + j * 16;
      if (o.epilogue == Epilogue::kGate) {
        const pagedq_vec::vfloat g = reinterpret_cast<const pagedq_vec::vfloat&>(v);
        const pagedq_vec::vfloat a = g / (1.f + pagedq_vec::exp_v(-g));
        __m512 act = reinterpret_cast<const __m512&>(a);
        if (!o.fp32_out) act = round_to_bf16(act);
        _mm512_storeu_ps(silu, act);
        continue;
      }
      v = _mm512_mul_ps(_mm512_loadu_ps(silu), v);
    }
    if (o.fp32_out) {
      float* dst = static_cast<float*>(o.base) + row * o.ld + col0 + j * 16;
      _mm512_mask_storeu_ps(dst, mask, v);
    } else {
      const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(round_to_bf16(v)), 16);
      uint16_t* dst = static_cast<uint16_t*>(o.base) + row * o.ld + col0 + j * 16;
      _mm256_mask_storeu_epi16(dst, mask, _mm512_cvtepi32_epi16(bits));
    }
  }
}

#else  // AVX2: the same epilogue on the sums as floats, in vectors of 8, lane for lane

inline void store_row(const Output& o, int64_t row, int64_t col0, const float* sums) {
  using namespace pagedq_vec;
  for (int64_t j = 0; j < o.valid; j += kLanes) {
    const int64_t left = std::min<int64_t>(kLanes, o.valid - j);
    alignas(32) float lane[kLanes] = {};
    vfloat v = loadv(sums + j);  // the row buffer is a whole block wide
    if (o.bias) {
      if (left == kLanes) {
        v += loadv(o.bias + j);
      } else {  // the last block: no bias past N
        std::memcpy(lane, o.bias + j, left * sizeof(float));
        v += loadv(lane);
      }
    }
    if (o.epilogue == Epilogue::kArgmax) {
      float& best = o.best[row];
      int64_t& index = o.best_index[row];
      for (int64_t l = 0; l < left; ++l) {
        if (index >= 0 && std::isnan(best)) break;  // the row's first NaN already won
        if (std::isnan(v[l])) {
          best = std::numeric_limits<float>::quiet_NaN();
          index = col0 + j + l;
        } else if (index < 0 || v[l] > best) {  // strictly: on a tie the earlier column stays
          best = v[l];
          index = col0 + j + l;
        }
      }
      continue;
    }
    if (o.epilogue != Epilogue::kStore) {
      // As above: the rounded gate and up values, then silu_and_mul's own arithmetic.
      if (!o.fp32_out) v = round_bf16(v);
      float* silu = o.silu + (row - o.silu_row0) * kNR + j;
      if (o.epilogue == Epilogue::kGate) {
        vfloat a = v / (1.f + exp_v(-v));
        if (!o.fp32_out) a = round_bf16(a);
        storev(silu, a);
        continue;
      }
      v = loadv(silu) * v;
    }
    if (o.fp32_out) {
      float* dst = static_cast<float*>(o.base) + row * o.ld + col0 + j;
      if (left == kLanes) {
        storev(dst, v);
      } else {
        storev(lane, v);
        std::memcpy(dst, lane, left * sizeof(float));
      }
    } else {
      uint16_t* dst = static_cast<uint16_t*>(o.base) + row * o.ld + col0 + j;
      if (left == kLanes) {
        narrow_bf16(dst, v);
      } else {
        alignas(32) uint16_t half[kLanes];
        narrow_bf16(half, v);
        std::memcpy(dst, half, left * sizeof(uint16_t));
      }
    }
  }
}

#endif  // __AVX512F__

// One column block over rows [m0, m1) in micro-kernels of up to kMR rows. `up` (the fused
// SiLU-and-mul) is the up block of the same columns: each micro-kernel's rows run the gate
// block, then the up block, while the silu values are in L1.
// With `amx` (bf16), whole groups of 32 rows run on AMX tiles first (they read 32 rows of x, so
// only whole groups go there), the gate and up blocks in turn where SiLU-and-mul is fused, and
// the rest on the micro-kernels: fused or not, a row's sums come from the same path.
template <typename T, template <int, int> class Kernel, int NV>
void block_rows(const T* x, int64_t ldx, const T* w, int64_t K, const char* next, const Output& o,
                int64_t m0, int64_t m1, int64_t col0, const T* up = nullptr,
                const char* up_next = nullptr, const float* up_bias = nullptr, bool amx = false) {
  int64_t m = m0;
#if defined(PAGEDQ_AMX)
  if constexpr (sizeof(T) == 2) {
    for (; amx && m + kAmxRows <= m1; m += kAmxRows) {
      if (up == nullptr) {
        amx_rows<NV>(kAmxRows, x, ldx, w, K, o, m, col0);
        continue;
      }
      Output gate = o, mul = o;
      gate.epilogue = Epilogue::kGate;
      mul.epilogue = Epilogue::kUpMul;
      mul.bias = up_bias;
      gate.silu_row0 = mul.silu_row0 = m;
      amx_rows<NV>(kAmxRows, x, ldx, w, K, gate, m, col0);
      amx_rows<NV>(kAmxRows, x, ldx, up, K, mul, m, col0);
    }
  }
#endif
  for (; m < m1; m += kMR) {
    const int rows = static_cast<int>(std::min<int64_t>(kMR, m1 - m));
    if (up == nullptr) {
      micro_rows<T, Kernel, NV>(rows, x, ldx, w, K, next, o, m, col0);
    } else {
      Output gate = o, mul = o;
      gate.epilogue = Epilogue::kGate;
      mul.epilogue = Epilogue::kUpMul;
      mul.bias = up_bias;
      gate.silu_row0 = mul.silu_row0 = m;
      micro_rows<T, Kernel, NV>(rows, x, ldx, w, K, next, gate, m, col0);
      micro_rows<T, Kernel, NV>(rows, x, ldx, up, K, up_next, mul, m, col0);
      up_next = nullptr;
    }
    next = nullptr;  // prefetched once, with the block's first rows
  }
}

// Tasks of (row pass, half column block): each thread walks a contiguous run of them, row pass
// by row pass, two halves of a block at a time where both are its own, prefetching the next
// block. Up to kMB rows there is one pass and the threads split the columns (each block read
// from DRAM once); in halves, so that 9 blocks (576 features) give 2 threads 4.5 each, not 5
// and 4 (such projections ran 1.10-1.14x oneDNN's time). With more rows (prefill chunks) the
// number of passes is raised by up to threads - 1 where that evens out the tasks.
inline int64_t row_passes(int64_t M, int64_t units, int64_t threads) {
  const int64_t base = (M + kMB - 1) / kMB;
  if (base < 2 || threads < 2) return base;
  for (int64_t passes = base; passes < base + threads; ++passes)
    if ((passes * units) % threads == 0) return passes;
  return base;
}

// N is the output width; with `silu_mul` the weight holds 2N features (gate, then up, N a
// multiple of kNR) and the output is silu(gate) * up.
template <typename T, template <int, int> class Kernel>
void run_linear(const T* x, int64_t ldx, const T* w, int64_t M, int64_t N, int64_t K,
                int64_t block_elems, const float* bias, void* out, bool fp32_out, bool silu_mul,
                std::vector<ArgmaxRun>* argmax) {
  const int64_t NB = (N + kNR - 1) / kNR, units = 2 * NB;
  const int64_t half_elems = kNR / 2 * (sizeof(T) == 2 ? 2 : 1);  // 32 columns' offset
  const int64_t passes = argmax ? 1 : row_passes(M, units, at::get_num_threads());
  const int64_t rows = (M + passes - 1) / passes;
  std::mutex argmax_lock;
  // AMX where a pass has a whole group of 32 rows: the LM head's fp32 logits of a decode batch
  // (the projections run on oneDNN's AMX where that measured faster).
  bool amx = false;
#if defined(PAGEDQ_AMX)
  amx = sizeof(T) == 2 && rows >= kAmxRows && amx_gemm_usable(K);
#endif
  at::parallel_for(0, passes * units, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) float silu[kSiluRows * kNR];
    const TileScope tiles(amx);
    ArgmaxRun run{t0, {}, {}};
    if (argmax) {
      run.best.assign(M, 0.f);
      run.index.assign(M, -1);
    }
    for (int64_t t = t0; t < t1;) {
      const int64_t u = t % units, nb = u / 2, m0 = t / units * rows;
      const int64_t m1 = std::min(M, m0 + rows);
      const bool whole = u % 2 == 0 && t + 1 < t1;
      const int64_t half = whole ? 0 : u % 2, col0 = nb * kNR + half * kNR / 2;
      t += whole ? 2 : 1;
      if (m0 >= m1 || col0 >= N) continue;
      const T* block = w + nb * block_elems + half * half_elems;
      const int64_t next_nb = (t % units) / 2;
      const char* next =
          t < t1 ? reinterpret_cast<const char*>(w + next_nb * block_elems) : nullptr;
      Output o{out, N, fp32_out, bias ? bias + col0 : nullptr,
               std::min(whole ? kNR : kNR / 2, N - col0)};
      o.silu = silu;
      if (argmax) {
        o.epilogue = Epilogue::kArgmax;
        o.best = run.best.data();
        o.best_index = run.index.data();
      }
      const T* up = silu_mul ? block + NB * block_elems : nullptr;
      const char* up_next =
          up && next ? reinterpret_cast<const char*>(w + (NB + next_nb) * block_elems) : nullptr;
      const float* up_bias = silu_mul && bias ? bias + N + col0 : nullptr;
      if (whole) {
        block_rows<T, Kernel, 4>(x, ldx, block, K, next, o, m0, m1, col0, up, up_next, up_bias,
                                 amx);
      } else {
        block_rows<T, Kernel, 2>(x, ldx, block, K, next, o, m0, m1, col0, up, up_next, up_bias,
                                 amx);
      }
    }
    if (argmax) {
      std::lock_guard<std::mutex> guard(argmax_lock);
      argmax->push_back(std::move(run));
    }
  });
}

#endif  // PAGEDQ_GEMM_FP32

// The dtype's kernels over x [M, K] and the packed weight, N output features: the output,
// silu_mul or argmax as run_linear takes them (out: `out_ptr`, fp32 or x's dtype).
void dispatch(const char* op, const at::Tensor& x, const at::Tensor& packed, int64_t N,
              const float* bias, void* out_ptr, bool fp32_out, bool silu_mul,
              std::vector<ArgmaxRun>* argmax) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [tokens, in], rows contiguous");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), op, ": x is ", x.scalar_type(),
              " but the weight is ", packed.scalar_type());
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.size(0) * kNR >= N, op, ": more features than the weight holds");
  if (M == 0) return;
#if defined(PAGEDQ_GEMM_FP32)
  if (x.scalar_type() == at::kFloat) {
    TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K, op, ": weight is not packed for in=", K);
    run_linear<float, Fp32Kernel>(x.data_ptr<float>(), x.stride(0), packed.data_ptr<float>(), M,
                                  N, K, K * kNR, bias, out_ptr, fp32_out, silu_mul, argmax);
    return;
  }
#if defined(PAGEDQ_GEMM_BF16)
  if (x.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(packed.dim() == 4 && packed.size(1) == (K + 1) / 2, op,
                ": weight is not packed for in=", K);
    run_linear<uint16_t, Bf16Kernel>(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0),
                                     reinterpret_cast<const uint16_t*>(packed.data_ptr()), M, N, K,
                                     (K + 1) / 2 * kNR * 2, bias, out_ptr, fp32_out, silu_mul,
                                     argmax);
    return;
  }
#endif
#endif
  TORCH_CHECK(false, op, ": dtype ", x.scalar_type(), " is not supported on this build");
}

// y [M, N] = x [M, K] @ W^T + bias; W packed by pack_linear_weight, bias fp32 [features] (or
// undefined). `out` is x's dtype or fp32. With `silu_mul`, W is gate_up's
// [2N, K] and y = silu(x @ gate^T) * (x @ up^T), as silu_and_mul computes it (N % 64 == 0).
void run_packed(const char* op, const at::Tensor& x, const at::Tensor& packed,
                const c10::optional<at::Tensor>& bias, at::Tensor& out, bool silu_mul) {
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == x.size(0), op, ": bad out");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() || out.scalar_type() == at::kFloat, op,
              ": out must be x's dtype or float32");
  const int64_t N = out.size(1);
  TORCH_CHECK(!silu_mul || (N % kNR == 0 && packed.size(0) == 2 * N / kNR), op,
              ": the weight must hold gate and up, ", N, " features each, a multiple of ", kNR);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous(), op, ": bias");
    b = bias->data_ptr<float>();
  }
  dispatch(op, x, packed, N, b, out.data_ptr(), out.scalar_type() == at::kFloat, silu_mul, nullptr);
}

void packed_linear(const at::Tensor& x, const at::Tensor& packed,
                   const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  run_packed("packed_linear", x, packed, bias, out, false);
}

void packed_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed,
                            const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  run_packed("packed_linear_silu_mul", x, packed, bias, out, true);
}

// out[r] = argmax_j (x @ W^T)[r, j], the first index of each row's largest logit (or first NaN),
// over the fp32 logits (the unrounded sums of bf16 products too); at most one row pass (kMB).
void packed_linear_argmax(const at::Tensor& x, const at::Tensor& packed, int64_t vocab,
                          at::Tensor& out) {
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 1 && out.size(0) == x.size(0) &&
                  out.is_contiguous(), "packed_linear_argmax: out must be int64 [tokens]");
  TORCH_CHECK(x.size(0) <= kMB, "packed_linear_argmax: at most ", kMB, " rows, got ", x.size(0));
  TORCH_CHECK(vocab > 0, "packed_linear_argmax: vocab must be positive");
  std::vector<ArgmaxRun> runs;
  dispatch("packed_linear_argmax", x, packed, vocab, nullptr, nullptr, true, false, &runs);
  // The threads' runs in column order: a later run wins only with a larger value, or with the
  // row's first NaN.
  std::sort(runs.begin(), runs.end(),
            [](const ArgmaxRun& a, const ArgmaxRun& b) { return a.first_task < b.first_task; });
  int64_t* dst = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < x.size(0); ++r) {
    float best = 0.f;
    int64_t index = -1;
    for (const ArgmaxRun& run : runs) {
      const int64_t i = run.index[r];
      if (i < 0) continue;
      if (index >= 0 && std::isnan(best)) break;
      if (std::isnan(run.best[r]) || index < 0 || run.best[r] > best) {
        best = run.best[r];
        index = i;
      }
    }
    dst[r] = index;
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedq, m) {
  m.def("packed_linear_available(ScalarType dtype) -> bool", &packed_linear_available);
  m.def("pack_linear_weight(Tensor weight) -> Tensor", &pack_linear_weight);
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("packed_linear_silu_mul(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("packed_linear_argmax(Tensor x, Tensor packed, int vocab, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pagedq, CPU, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("packed_linear_silu_mul", &packed_linear_silu_mul);
  m.impl("packed_linear_argmax", &packed_linear_argmax);
}
