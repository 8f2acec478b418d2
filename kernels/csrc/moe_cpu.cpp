// Mixture-of-experts layers on the CPU: out[t] = sum_j w[t, j] * expert_{id[t, j]}(x[t]), every
// expert a gated MLP (gate_up, an activation, down), as grouped GEMMs over weights packed once
// per expert in gemm_cpu.h's layout.
//
// A decode step routes each token to top_k of E experts, so that every expert sees a few rows
// (32 tokens x top-8 of 64: 4 each) and the step is bound by reading each expert's weights from
// DRAM once. One call does the whole layer:
//   1. the (token, slot) pairs are sorted by expert (a counting sort: ascending tokens within
//      each expert) and x's rows gathered in that order, so that each expert's rows are one
//      contiguous block;
//   2. gate_up: tasks of (expert, column block of the intermediate), each the gate block and
//      then the up block of the same columns over the expert's rows, the activation fused into
//      the up block's epilogue (the [rows, 2 x intermediate] product is never written); the
//      tasks are split over the threads in contiguous runs of equal cost (a weight block's
//      stream plus its rows), and each task prefetches the next task's blocks into L2;
//   3. down: the threads split the hidden columns (in half blocks) and walk every expert for
//      their own columns, so that each output element has one writer and its sum runs in
//      ascending expert order, as Hugging Face's index_add_ loop adds them; the epilogue scales
//      each row by its routing weight and adds it into an fp32 accumulator of [tokens, hidden]
//      (the output itself in fp32; rounded to bf16 at the end otherwise).
// bf16: the gate, up and activation values stay fp32 in registers and the intermediate is
// rounded to bf16 once (the down GEMM's input); each expert's down output is weighted and summed
// in fp32, rounded once at the end. A bf16 model in Hugging Face rounds each linear output and
// the activation too: 1-2 more roundings per value, and pagedq's bf16 is meant to stay at least
// as close to fp32 as that (bench/fidelity.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_gemm_cpu.h"
#include "gemm_cpu.h"
#include "vec_cpu.h"

namespace {

using namespace pagedq_gemm;

enum Activation : int64_t { kSiluMul = 0, kSwigluOai = 1 };

bool fused_moe_available(c10::ScalarType dtype) {
#if defined(PAGEDQ_GEMM_FP32)
  if (dtype == at::kFloat) return true;
#endif
#if defined(PAGEDQ_GEMM_BF16)
  if (dtype == at::kBFloat16) return true;
#endif
  return false;
}

#if defined(PAGEDQ_GEMM_FP32)

#if defined(PAGEDQ_AMX)
constexpr int64_t kAmxMinRows = 16;  // an expert's rows from which its products go to AMX
// Rows of the largest chunk of one column block (an AMX pass's; a micro-kernel's without AMX).
constexpr int kMaxChunkRows = kAmxRows > kMR ? kAmxRows : kMR;
#else
constexpr int64_t kAmxMinRows = 0;  // unused: no expert goes to tiles without AMX
constexpr int64_t kAmxRows = 0;
constexpr int kMaxChunkRows = kMR;
#endif


// (token, slot) pairs grouped by expert: expert e owns rows [offsets[e], offsets[e + 1]) of the
// gathered x, row r being pair order[r] (= token * top_k + slot).
struct Routing {
  std::vector<int64_t> offsets, order;
};

Routing group_by_expert(const int64_t* ids, int64_t pairs, int64_t E) {
  Routing g;
  g.offsets.assign(E + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < E, "fused_moe: expert id ", ids[p], " is not in [0, ", E,
                ")");
    ++g.offsets[ids[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) g.offsets[e + 1] += g.offsets[e];
  std::vector<int64_t> next(g.offsets.begin(), g.offsets.end() - 1);
  g.order.resize(pairs);
  for (int64_t p = 0; p < pairs; ++p) g.order[next[ids[p]]++] = p;
  return g;
}

// gate_up's epilogue: the gate block's pass writes the activated gate of kMR x 64 values to
// `act`; the up block's pass multiplies its values by them into the intermediate rows.
struct GateUpOut {
  bool up_pass;
  bool bf16;
  int64_t activation;
  float alpha, limit;
  const float* bias;  // this block's 64 gate (or up) biases, or nullptr
  float* act;         // kMR x 64
  int64_t act_row0;
  void* inter;  // [rows, ld] of x's dtype
  int64_t ld;
};

// down's epilogue: each row (a (token, slot) pair) times its routing weight, added into the
// token's row of the fp32 accumulator.
struct DownOut {
  bool bf16;
  const float* bias;  // this expert's biases from col0, or nullptr
  int64_t valid;      // columns of this (half) block inside hidden
  const int64_t* order;
  const float* weights;  // [tokens * top_k]
  int64_t top_k;
  float* acc;  // [tokens, ld]
  int64_t ld;
};

#if defined(__AVX512F__)

inline __m512 sigmoid_times(__m512 g, __m512 z) {  // g / (1 + exp(-z))
  const pagedq_vec::vfloat zv = reinterpret_cast<const pagedq_vec::vfloat&>(z);
  const pagedq_vec::vfloat d = 1.f + pagedq_vec::exp_v(-zv);
  return _mm512_div_ps(g, reinterpret_cast<const __m512&>(d));
}

inline void store_row(const GateUpOut& o, int64_t row, int64_t col0, const __m512* acc) {
  for (int j = 0; j < 4; ++j) {
    __m512 v = acc[j];
    if (o.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(o.bias + j * 16));
    float* act = o.act + (row - o.act_row0) * kNR + j * 16;
    if (!o.up_pass) {
      __m512 a;
      if (o.activation == kSwigluOai) {  // gate.clamp(max=limit) * sigmoid(alpha * gate)
        const __m512 g = _mm512_min_ps(v, _mm512_set1_ps(o.limit));
        a = sigmoid_times(g, _mm512_mul_ps(g, _mm512_set1_ps(o.alpha)));
      } else {  // silu(gate)
        a = sigmoid_times(v, v);
      }
      _mm512_storeu_ps(act, a);
      continue;
    }
    if (o.activation == kSwigluOai) {  // (up.clamp(-limit, limit) + 1) * glu
      v = _mm512_max_ps(_mm512_min_ps(v, _mm512_set1_ps(o.limit)), _mm512_set1_ps(-o.limit));
      v = _mm512_add_ps(v, _mm512_set1_ps(1.f));
    }
    v = _mm512_mul_ps(_mm512_loadu_ps(act), v);
    if (o.bf16) {
      const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(round_to_bf16(v)), 16);
      uint16_t* dst = static_cast<uint16_t*>(o.inter) + row * o.ld + col0 + j * 16;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(bits));
    } else {
      _mm512_storeu_ps(static_cast<float*>(o.inter) + row * o.ld + col0 + j * 16, v);
    }
  }
}

inline void store_row(const DownOut& o, int64_t row, int64_t col0, const __m512* acc) {
  const int64_t pair = o.order[row];
  const __m512 w = _mm512_set1_ps(o.weights[pair]);
  float* dst = o.acc + pair / o.top_k * o.ld + col0;
  for (int j = 0; j < 4; ++j) {
    const int64_t left = o.valid - j * 16;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    __m512 v = acc[j];
    if (o.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, o.bias + j * 16));
    v = _mm512_mul_ps(v, w);
    const __m512 sum = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, dst + j * 16), v);
    _mm512_mask_storeu_ps(dst + j * 16, mask, sum);
  }
}

// This thread's columns [c0, c1) of the fp32 sums, rounded to bf16 once.
inline void round_columns(const float* acc, uint16_t* dst, int64_t T_, int64_t H, int64_t c0,
                          int64_t c1) {
  for (int64_t t = 0; t < T_; ++t) {
    for (int64_t c = c0; c < c1; c += 16) {
      const int64_t left = c1 - c;
      const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(mask, acc + t * H + c);
      const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(round_to_bf16(v)), 16);
      _mm256_mask_storeu_epi16(dst + t * H + c, mask, _mm512_cvtepi32_epi16(bits));
    }
  }
}

#else  // AVX2: the same epilogues on the sums as floats, in vectors of 8

using pagedq_vec::kLanes;
using pagedq_vec::vfloat;

inline vfloat sigmoid_times(vfloat g, vfloat z) { return g / (1.f + pagedq_vec::exp_v(-z)); }

inline void store_row(const GateUpOut& o, int64_t row, int64_t col0, const float* sums) {
  using pagedq_vec::loadv;
  using pagedq_vec::storev;
  for (int j = 0; j < kNR; j += kLanes) {
    vfloat v = loadv(sums + j);
    if (o.bias) v += loadv(o.bias + j);
    float* act = o.act + (row - o.act_row0) * kNR + j;
    if (!o.up_pass) {
      vfloat a;
      if (o.activation == kSwigluOai) {  // gate.clamp(max=limit) * sigmoid(alpha * gate)
        const vfloat limit = vfloat{} + o.limit;
        const vfloat g = v < limit ? v : limit;
        a = sigmoid_times(g, g * o.alpha);
      } else {  // silu(gate)
        a = sigmoid_times(v, v);
      }
      storev(act, a);
      continue;
    }
    if (o.activation == kSwigluOai) {  // (up.clamp(-limit, limit) + 1) * glu
      const vfloat limit = vfloat{} + o.limit;
      v = v < limit ? v : limit;
      v = v > -limit ? v : -limit;
      v += 1.f;
    }
    v = loadv(act) * v;
    if (o.bf16) {
      pagedq_vec::narrow_bf16(static_cast<uint16_t*>(o.inter) + row * o.ld + col0 + j, v);
    } else {
      storev(static_cast<float*>(o.inter) + row * o.ld + col0 + j, v);
    }
  }
}

inline void store_row(const DownOut& o, int64_t row, int64_t col0, const float* sums) {
  const int64_t pair = o.order[row];
  const float w = o.weights[pair];
  float* dst = o.acc + pair / o.top_k * o.ld + col0;
  int64_t j = 0;
  for (; j + kLanes <= o.valid; j += kLanes) {
    vfloat v = pagedq_vec::loadv(sums + j);
    if (o.bias) v += pagedq_vec::loadv(o.bias + j);
    pagedq_vec::storev(dst + j, pagedq_vec::loadv(dst + j) + v * w);
  }
  for (; j < o.valid; ++j) {  // the last block's columns past a multiple of 8
    float v = sums[j] + (o.bias ? o.bias[j] : 0.f);
    dst[j] += v * w;
  }
}

inline void round_columns(const float* acc, uint16_t* dst, int64_t T_, int64_t H, int64_t c0,
                          int64_t c1) {
  for (int64_t t = 0; t < T_; ++t) {
    int64_t c = c0;
    for (; c + kLanes <= c1; c += kLanes)
      pagedq_vec::narrow_bf16(dst + t * H + c, pagedq_vec::loadv(acc + t * H + c));
    for (; c < c1; ++c) dst[t * H + c] = c10::BFloat16(acc[t * H + c]).x;
  }
}

#endif  // __AVX512F__

// A run of contiguous tasks of about equal cost for thread `i` of `threads`: [first, last).
std::pair<int64_t, int64_t> share(const std::vector<double>& prefix, int64_t i, int64_t threads) {
  const double total = prefix.back();
  auto at = [&](int64_t k) {
    if (k >= threads) return static_cast<int64_t>(prefix.size()) - 1;
    const double target = total * k / threads;
    return static_cast<int64_t>(std::lower_bound(prefix.begin(), prefix.end(), target) -
                                prefix.begin());
  };
  return {std::min(at(i), int64_t(prefix.size()) - 1), at(i + 1)};
}

// Rows per chunk of one column block: a tile pass's on AMX, a micro-kernel's otherwise.
inline int64_t chunk_rows(bool amx) { return amx ? kMaxChunkRows : kMR; }

// Rows [m, m + rows) of x (rows <= chunk_rows(amx)) against one column block: on AMX tiles
// (bf16, `amx`) or in one AVX micro-kernel, which prefetches `next`.
template <typename T, template <int, int> class Kernel, int NV, class O>
void chunk(bool amx, int rows, const T* x, int64_t ldx, const T* w, int64_t K, const char* next,
           const O& o, int64_t m, int64_t col0) {
#if defined(PAGEDQ_AMX)
  if constexpr (sizeof(T) == 2) {
    if (amx) {
      amx_rows<NV>(rows, x, ldx, w, K, o, m, col0);
      return;
    }
  }
#endif
  micro_rows<T, Kernel, NV>(rows, x, ldx, w, K, next, o, m, col0);
}

// Rows [m0, m1) of x against one column block, in chunks.
template <typename T, template <int, int> class Kernel, int NV, class O>
void rows_of_block(const T* x, int64_t ldx, const T* w, int64_t K, const char* next, O o,
                   int64_t m0, int64_t m1, int64_t col0, bool amx) {
  const int64_t step = chunk_rows(amx);
  for (int64_t m = m0; m < m1; m += step) {
    const int rows = static_cast<int>(std::min<int64_t>(step, m1 - m));
    chunk<T, Kernel, NV>(amx, rows, x, ldx, w, K, next, o, m, col0);
    next = nullptr;  // prefetched once, with the block's first rows
  }
}

template <typename T, template <int, int> class Kernel>
void run_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const float* b13,
             const float* b2, const float* weights, const int64_t* ids, int64_t top_k,
             int64_t activation, float alpha, float limit, at::Tensor& out) {
  constexpr bool bf16 = sizeof(T) == 2;
  const int64_t T_ = x.size(0), H = x.size(1), E = w13.size(0);
  const int64_t NBi = w13.size(1) / 2, Ip = NBi * kNR, NBh = w2.size(1);
  const int64_t pack = bf16 ? 2 : 1;  // k values per packed row
  const int64_t elems13 = (H + pack - 1) / pack * kNR * pack, elems2 = Ip / pack * kNR * pack;
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* w13p = reinterpret_cast<const T*>(w13.data_ptr());
  const T* w2p = reinterpret_cast<const T*>(w2.data_ptr());
  const int64_t pairs = T_ * top_k;
  const Routing g = group_by_expert(ids, pairs, E);
  const int64_t threads = at::get_num_threads();
  // Experts with this many rows run on AMX tiles where the host has them (bf16): a prefill's.
  // With fewer (a decode's 4) the step streams the weights, and the AVX kernels prefetch them.
  bool amx = false;
#if defined(PAGEDQ_AMX)
  if constexpr (bf16) {
    int64_t most = 0;
    for (int64_t e = 0; e < E; ++e) most = std::max(most, g.offsets[e + 1] - g.offsets[e]);
    amx = most >= kAmxMinRows && amx_gemm_usable(H) && amx_gemm_usable(Ip);
  }
#endif
  auto on_amx = [&](int64_t e) { return amx && g.offsets[e + 1] - g.offsets[e] >= kAmxMinRows; };
  // The tile path reads whole blocks of kAmxRows rows: as many spare rows past the last.
  const int64_t spare = amx ? kAmxRows : 0;

  // 1. x's rows in expert order. Up to 1 MB (a decode step's 32 x top-8 rows of 1024 are 0.5 MB
  // in bf16) are copied by the calling thread: one parallel region fewer per layer, each of
  // which waits for every thread to be scheduled (on a loaded host, a time slice).
  at::Tensor xs = at::empty({pairs + spare, H}, x.options());
  T* xsp = reinterpret_cast<T*>(xs.data_ptr());
  if (spare) std::memset(xsp + pairs * H, 0, spare * H * sizeof(T));
  const int64_t gather_grain = std::max<int64_t>(1, (int64_t(1) << 20) / (H * int64_t(sizeof(T))));
  at::parallel_for(0, pairs, gather_grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      std::memcpy(xsp + r * H, xp + g.order[r] / top_k * H, H * sizeof(T));
  });

  // 2. gate_up and the activation: tasks of (expert, column block), costed as a block's weight
  // stream (about as long as kStreamRows rows of products: 256 KB of bf16 at ~6 GB/s per core
  // against ~5 us per row) plus the expert's rows.
  constexpr double kStreamRows = 8.0;
  std::vector<int64_t> task_e, task_b;
  std::vector<double> prefix{0.0};
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = g.offsets[e + 1] - g.offsets[e];
    if (rows == 0) continue;
    for (int64_t b = 0; b < NBi; ++b) {
      task_e.push_back(e);
      task_b.push_back(b);
      prefix.push_back(prefix.back() + kStreamRows + rows);
    }
  }
  at::Tensor inter = at::empty({pairs + spare, Ip}, x.options());
  T* interp = reinterpret_cast<T*>(inter.data_ptr());
  if (spare) std::memset(interp + pairs * Ip, 0, spare * Ip * sizeof(T));
  at::parallel_for(0, threads, 1, [&](int64_t i0, int64_t i1) {
    alignas(64) float act[kMaxChunkRows * kNR];
    const TileScope tiles(amx);
    for (int64_t i = i0; i < i1; ++i) {
      const auto [first, last] = share(prefix, i, threads);
      for (int64_t t = first; t < last; ++t) {
        const int64_t e = task_e[t], b = task_b[t];
        const T* gate = w13p + (e * 2 * NBi + b) * elems13;
        const T* up = gate + NBi * elems13;
        const char* next = nullptr;
        const char* up_next = nullptr;
        if (t + 1 < last) {
          const T* ng = w13p + (task_e[t + 1] * 2 * NBi + task_b[t + 1]) * elems13;
          next = reinterpret_cast<const char*>(ng);
          up_next = reinterpret_cast<const char*>(ng + NBi * elems13);
        }
#if defined(PAGEDQ_GEMM_AVX2)
        // The AVX2 kernels prefetch a short distance ahead into the block read right after:
        // the up block after the gate block, the next task's gate block after the up block.
        up_next = next;
        next = reinterpret_cast<const char*>(up);
#endif
        GateUpOut o{false, bf16, activation, alpha, limit, nullptr, act, 0, interp, Ip};
        GateUpOut mul = o;
        mul.up_pass = true;
        if (b13) {
          o.bias = b13 + e * 2 * Ip + b * kNR;
          mul.bias = o.bias + Ip;
        }
        const bool tiles_e = on_amx(e);
        const int64_t step = chunk_rows(tiles_e);
        for (int64_t m = g.offsets[e]; m < g.offsets[e + 1]; m += step) {
          const int rows = static_cast<int>(std::min<int64_t>(step, g.offsets[e + 1] - m));
          o.act_row0 = mul.act_row0 = m;
          chunk<T, Kernel, 4>(tiles_e, rows, xsp, H, gate, H, next, o, m, b * kNR);
          chunk<T, Kernel, 4>(tiles_e, rows, xsp, H, up, H, up_next, mul, m, b * kNR);
          next = up_next = nullptr;
        }
      }
    }
  });

  // 3. down, weighted and summed per token: the threads split the hidden columns in half blocks.
  const bool fp32_out = out.scalar_type() == at::kFloat;
  at::Tensor acc_t = fp32_out ? out : at::empty({T_, H}, x.options().dtype(at::kFloat));
  float* acc = acc_t.data_ptr<float>();
  const int64_t units = 2 * NBh, half = kNR / 2;
  const int64_t half_elems = half * pack;  // 32 columns' offset inside a packed row
  std::vector<int64_t> experts;
  for (int64_t e = 0; e < E; ++e)
    if (g.offsets[e + 1] > g.offsets[e]) experts.push_back(e);
  at::parallel_for(0, threads, 1, [&](int64_t i0, int64_t i1) {
    const TileScope tiles(amx);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t u0 = units * i / threads, u1 = units * (i + 1) / threads;
      const int64_t c0 = std::min(H, u0 * half), c1 = std::min(H, u1 * half);
      if (c0 >= c1) continue;
      for (int64_t t = 0; t < T_; ++t) std::memset(acc + t * H + c0, 0, (c1 - c0) * sizeof(float));
      for (int64_t u = u0; u < u1;) {
        const bool whole = u % 2 == 0 && u + 1 < u1;
        const int64_t nb = u / 2, hb = whole ? 0 : u % 2, col0 = nb * kNR + hb * half;
        u += whole ? 2 : 1;
        if (col0 >= H) continue;
        DownOut o{bf16, nullptr, std::min(whole ? kNR : half, H - col0), g.order.data(),
                  weights, top_k, acc, H};
        for (size_t k = 0; k < experts.size(); ++k) {
          const int64_t e = experts[k];
          const T* block = w2p + (e * NBh + nb) * elems2 + hb * half_elems;
          const char* next =
              k + 1 < experts.size()
                  ? reinterpret_cast<const char*>(w2p + (experts[k + 1] * NBh + nb) * elems2)
                  : nullptr;
          o.bias = b2 ? b2 + e * H + col0 : nullptr;
          if (whole) {
            rows_of_block<T, Kernel, 4>(interp, Ip, block, Ip, next, o, g.offsets[e],
                                        g.offsets[e + 1], col0, on_amx(e));
          } else {
            rows_of_block<T, Kernel, 2>(interp, Ip, block, Ip, next, o, g.offsets[e],
                                        g.offsets[e + 1], col0, on_amx(e));
          }
        }
      }
      if (!fp32_out)  // this thread's columns, rounded to bf16 once
        round_columns(acc, reinterpret_cast<uint16_t*>(out.data_ptr()), T_, H, c0, c1);
    }
  });
}

#endif  // PAGEDQ_GEMM_FP32

// out [tokens, hidden] = sum over each token's top_k experts of weight * down(act(gate_up(x))).
// w13: per expert gate_up packed by pack_linear_weight and stacked, [E, 2 * NBi, ...] with the
// gate's NBi column blocks first and the up's next (the intermediate zero-padded to NBi * 64);
// w2: per expert down packed, [E, ceil(hidden / 64), ...] over K = NBi * 64 (zero-padded).
// Biases fp32: w13_bias [E, 2 * NBi * 64] (gate, then up, padded alike), w2_bias [E, hidden].
// topk_weights fp32 and topk_ids int64, both [tokens, top_k]. activation: 0 SiLU-and-mul,
// 1 gpt-oss's clamped SwiGLU with `alpha` and `limit`.
void fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
               const c10::optional<at::Tensor>& w13_bias, const c10::optional<at::Tensor>& w2_bias,
               const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t activation,
               double alpha, double limit, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "fused_moe: x must be [tokens, hidden], contiguous");
  TORCH_CHECK(x.scalar_type() == w13.scalar_type() && x.scalar_type() == w2.scalar_type(),
              "fused_moe: x is ", x.scalar_type(), " but the weights are ", w13.scalar_type());
  TORCH_CHECK(fused_moe_available(x.scalar_type()), "fused_moe: dtype ", x.scalar_type(),
              " is not supported on this build");
  TORCH_CHECK(activation == kSiluMul || activation == kSwigluOai,
              "fused_moe: activation must be 0 (silu) or 1 (swigluoai), got ", activation);
  const int64_t T_ = x.size(0), H = x.size(1), E = w13.size(0);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(w13.dim() == (bf16 ? 5 : 4) && w2.dim() == w13.dim() && w2.size(0) == E &&
                  w13.size(1) % 2 == 0 && w13.is_contiguous() && w2.is_contiguous(),
              "fused_moe: w13 and w2 must be stacked packed weights of the same experts");
  const int64_t Ip = w13.size(1) / 2 * kNR;
  TORCH_CHECK(w13.size(2) == (bf16 ? (H + 1) / 2 : H), "fused_moe: w13 is not packed for hidden=", H);
  TORCH_CHECK(w2.size(1) * kNR >= H && w2.size(1) * kNR < H + kNR &&
                  w2.size(2) == (bf16 ? Ip / 2 : Ip),
              "fused_moe: w2 is not packed for hidden=", H, " and intermediate=", Ip);
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_ids.is_contiguous() &&
                  topk_ids.dim() == 2 && topk_ids.size(0) == T_,
              "fused_moe: topk_ids must be int64 [tokens, top_k], contiguous");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.is_contiguous() &&
                  topk_weights.sizes() == topk_ids.sizes(),
              "fused_moe: topk_weights must be float32 like topk_ids");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() &&
                  (out.scalar_type() == x.scalar_type() || out.scalar_type() == at::kFloat),
              "fused_moe: out must be [tokens, hidden] of x's dtype or float32");
  const float* b13 = nullptr;
  const float* b2 = nullptr;
  if (w13_bias.has_value() && w13_bias->defined()) {
    TORCH_CHECK(w13_bias->scalar_type() == at::kFloat && w13_bias->is_contiguous() &&
                    w13_bias->numel() == E * 2 * Ip, "fused_moe: w13_bias must be float32 [E, ", 2 * Ip, "]");
    b13 = w13_bias->data_ptr<float>();
  }
  if (w2_bias.has_value() && w2_bias->defined()) {
    TORCH_CHECK(w2_bias->scalar_type() == at::kFloat && w2_bias->is_contiguous() &&
                    w2_bias->numel() == E * H, "fused_moe: w2_bias must be float32 [E, ", H, "]");
    b2 = w2_bias->data_ptr<float>();
  }
  if (T_ == 0) return;
  const int64_t top_k = topk_ids.size(1);
#if defined(PAGEDQ_GEMM_FP32)
  if (!bf16) {
    run_moe<float, Fp32Kernel>(x, w13, w2, b13, b2, topk_weights.data_ptr<float>(),
                               topk_ids.data_ptr<int64_t>(), top_k, activation, float(alpha),
                               float(limit), out);
    return;
  }
#if defined(PAGEDQ_GEMM_BF16)
  run_moe<uint16_t, Bf16Kernel>(x, w13, w2, b13, b2, topk_weights.data_ptr<float>(),
                                topk_ids.data_ptr<int64_t>(), top_k, activation, float(alpha),
                                float(limit), out);
#endif
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedq, m) {
  m.def("fused_moe_available(ScalarType dtype) -> bool", &fused_moe_available);
  m.def(
      "fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor? w13_bias, Tensor? w2_bias, "
      "Tensor topk_weights, Tensor topk_ids, int activation, float alpha, float limit, "
      "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pagedq, CPU, m) { m.impl("fused_moe", &fused_moe); }
