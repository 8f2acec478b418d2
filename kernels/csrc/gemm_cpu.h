// The micro-kernels of pagedq's GEMM over packed weights, shared by the projections
// (linear_cpu.cpp) and the grouped expert GEMMs of mixture-of-experts layers (moe_cpu.cpp):
// AVX-512 here, AVX2 in gemm_avx2_cpu.h (PAGEDQ_GEMM_FP32 / _BF16 say what this build has).
//
// Layout: W [N, K] packed as column blocks of 64 (kNR) output features, zero-padded:
//   fp32  [N/64][K][64]            one row of 64 floats per k
//   bf16  [N/64][ceil(K/2)][64][2] k-pairs interleaved, the order of vdpbf16ps (AVX512-BF16)
// A micro-kernel keeps MR x NV vectors of 16 sums in registers; per k (pair) it loads NV vectors
// of weights and broadcasts one x value (pair) per row. Its sums go to an epilogue: each caller's
// own type O, with `store_row(const O&, int64_t row, int64_t col0, const __m512* acc)` found by
// argument-dependent lookup (a bias, a rounding, an activation, a weighted scatter-add...).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDQ_GEMM_FP32 1
#if defined(__AVX512BF16__)
#define PAGEDQ_GEMM_BF16 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDQ_GEMM_FP32 1
#define PAGEDQ_GEMM_BF16 1  // widened to fp32 in registers
#define PAGEDQ_GEMM_AVX2 1
#endif

namespace pagedq_gemm {

constexpr int64_t kNR = 64;  // output features per column block (4 vectors of 16)
// Rows per micro-kernel: 24 sums + 4 weights + 1 x in 32 zmm; 12 + 2 + 1 in 16 ymm (AVX2).
constexpr int kMR = 6;

#if defined(__AVX512F__)

inline __m512 round_to_bf16(__m512 v) {
  // Round to nearest even, NaN kept quiet: c10::BFloat16's rule, as a bf16 output gets it.
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(int32_t(0xFFFF0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i quiet = _mm512_and_si512(_mm512_or_si512(bits, _mm512_set1_epi32(0x400000)),
                                         _mm512_set1_epi32(int32_t(0xFFFF0000u)));
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, nan, quiet));
}

// Prefetches 64 bytes x 4 of `next` (the same k rows of the next block) into L2.
inline void prefetch_rows(const char* next) {
  _mm_prefetch(next, _MM_HINT_T1);
  _mm_prefetch(next + 64, _MM_HINT_T1);
  _mm_prefetch(next + 128, _MM_HINT_T1);
  _mm_prefetch(next + 192, _MM_HINT_T1);
}

// NV vectors of 16 columns: 4 (a whole block) or 2 (half a block, where the threads split one).
template <int MR, int NV, class O>
void micro_fp32(const float* x, int64_t ldx, const float* w, int64_t K, const char* next,
                const O& o, int64_t row0, int64_t col0) {
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* b = w + k * kNR;
    if (next) prefetch_rows(next + k * kNR * 4);
    __m512 bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = _mm512_loadu_ps(b + j * 16);
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_fmadd_ps(a, bv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r) store_row(o, row0 + r, col0, acc[r]);
}

#if defined(__AVX512BF16__)
template <int MR, int NV, class O>
void micro_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, const char* next,
                const O& o, int64_t row0, int64_t col0) {
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t pairs = K / 2, K2 = (K + 1) / 2;
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    const uint16_t* b = w + k2 * kNR * 2;
    if (next) prefetch_rows(next + k2 * kNR * 4);
    __m512bh bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(b + j * 32);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      if (k2 < pairs) {
        std::memcpy(&pair, x + r * ldx + 2 * k2, 4);
      } else {  // odd K: the last x value alone, its partner weight is padding (zero)
        pair = x[r * ldx + 2 * k2];
      }
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, bv[j]);
    }
  }
  for (int r = 0; r < MR; ++r) store_row(o, row0 + r, col0, acc[r]);
}
#endif

#endif  // __AVX512F__

}  // namespace pagedq_gemm

#if defined(PAGEDQ_GEMM_AVX2)
#include "gemm_avx2_cpu.h"
#endif

namespace pagedq_gemm {

#if defined(PAGEDQ_GEMM_FP32)

// The micro-kernels of this build (AVX-512 above or AVX2), as the callers' loops name them.
template <int MR, int NV>
struct Fp32Kernel {
  template <class O>
  static void run(const float* x, int64_t ldx, const float* w, int64_t K, const char* next,
                  const O& o, int64_t row0, int64_t col0) {
    micro_fp32<MR, NV>(x, ldx, w, K, next, o, row0, col0);
  }
};

#if defined(PAGEDQ_GEMM_BF16)
template <int MR, int NV>
struct Bf16Kernel {
  template <class O>
  static void run(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K,
                  const char* next, const O& o, int64_t row0, int64_t col0) {
    micro_bf16<MR, NV>(x, ldx, w, K, next, o, row0, col0);
  }
};
#endif

// `rows` (1 to kMR) rows from row m of x against one column block: one micro-kernel.
template <typename T, template <int, int> class Kernel, int NV, class O>
void micro_rows(int rows, const T* x, int64_t ldx, const T* w, int64_t K, const char* next,
                const O& o, int64_t m, int64_t col0) {
  static_assert(kMR == 6, "micro_rows dispatches 1-6 rows");
  switch (rows) {
    case 6: Kernel<6, NV>::run(x + m * ldx, ldx, w, K, next, o, m, col0); break;
    case 5: Kernel<5, NV>::run(x + m * ldx, ldx, w, K, next, o, m, col0); break;
    case 4: Kernel<4, NV>::run(x + m * ldx, ldx, w, K, next, o, m, col0); break;
    case 3: Kernel<3, NV>::run(x + m * ldx, ldx, w, K, next, o, m, col0); break;
    case 2: Kernel<2, NV>::run(x + m * ldx, ldx, w, K, next, o, m, col0); break;
    case 1: Kernel<1, NV>::run(x + m * ldx, ldx, w, K, next, o, m, col0); break;
    default: break;
  }
}

#endif  // PAGEDQ_GEMM_FP32

}  // namespace pagedq_gemm
