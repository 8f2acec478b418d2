// The AVX2 (+FMA) micro-kernels of pagedq's GEMM, for hosts without AVX-512 (AMD Zen 2 and 3,
// Intel before Skylake-SP, an image built for x86-64-v3): the same packed layout as gemm_cpu.h,
// so that the packers and the callers' loops are the same on every host.
//
// 16 ymm registers hold 6 rows x 16 columns of sums (12), two weight vectors and one x value:
// a block's 64 columns are four strips of 16. Running each strip over the whole K would read
// the block four times over, each pass taking one 64-byte line of every 256-byte k row, so K
// goes in chunks of kKc: the four strips run over one chunk (in L1) before the next, their
// sums parked in a row buffer between strips. The sums reach the caller's epilogue as floats:
// `store_row(const O&, int64_t row, int64_t col0, const float*)`, NV x 16 of them.
// bf16 weights (and x) are widened to fp32 in registers: a k-pair row's 32-bit lane holds the
// even k in its low half and the odd k in its high half, so a shift and a mask give both.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace pagedq_gemm {

constexpr int64_t kKc = 16;     // k values (k-pairs in bf16) per chunk: 4 KB of one block
constexpr int64_t kAhead = 32;  // rows (of 256 bytes) prefetched ahead of the one in use

// Loads row k + kAhead of the current block, or of the next block once k + kAhead is past K,
// into L1 while row k is used: the strips jump between a row's lines, which the hardware
// prefetcher follows less well than one stream (the kernel read 9.8 GB/s without this, 12-16
// with it, where a plain read of the same weights ran 18-22). Unlike the AVX-512 kernels, the
// next block is not brought into L2 whole: these CPUs' 512 KB L2 holds one 256 KB block well,
// not two.
inline void prefetch_ahead(const char* block, const char* next, int64_t k, int64_t K) {
  constexpr int64_t row = kNR * 4;
  const char* p = k + kAhead < K ? block + (k + kAhead) * row
                  : next         ? next + (k + kAhead - K) * row
                                 : nullptr;
  if (!p) return;
  _mm_prefetch(p, _MM_HINT_T0);
  _mm_prefetch(p + 64, _MM_HINT_T0);
  _mm_prefetch(p + 128, _MM_HINT_T0);
  _mm_prefetch(p + 192, _MM_HINT_T0);
}

// A strip's sums in registers: zero at the first chunk, else parked in the row buffer.
template <int MR>
inline void load_strip(__m256 (&acc)[MR][2], const float (&sums)[MR][kNR], int s, bool first) {
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 2; ++j)
      acc[r][j] = first ? _mm256_setzero_ps() : _mm256_load_ps(&sums[r][s * 16 + j * 8]);
}

template <int MR>
inline void park_strip(const __m256 (&acc)[MR][2], float (&sums)[MR][kNR], int s) {
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 2; ++j) _mm256_store_ps(&sums[r][s * 16 + j * 8], acc[r][j]);
}

// NV strips of 16 columns: 4 (a whole block) or 2 (half a block, where the threads split one).
template <int MR, int NV, class O>
void micro_fp32(const float* x, int64_t ldx, const float* w, int64_t K, const char* next,
                const O& o, int64_t row0, int64_t col0) {
  alignas(32) float sums[MR][kNR];
  if (K == 0) std::memset(sums, 0, sizeof(sums));
  for (int64_t k0 = 0; k0 < K; k0 += kKc) {
    const int64_t k1 = std::min(K, k0 + kKc);
    for (int s = 0; s < NV; ++s) {
      __m256 acc[MR][2];
      load_strip<MR>(acc, sums, s, k0 == 0);
      for (int64_t k = k0; k < k1; ++k) {
        const float* b = w + k * kNR + s * 16;
        if (s == 0) prefetch_ahead(reinterpret_cast<const char*>(w), next, k, K);
        const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
        for (int r = 0; r < MR; ++r) {
          const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
          acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
        }
      }
      park_strip<MR>(acc, sums, s);
    }
  }
  for (int r = 0; r < MR; ++r) store_row(o, row0 + r, col0, sums[r]);
}

template <int MR, int NV, class O>
void micro_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, const char* next,
                const O& o, int64_t row0, int64_t col0) {
  alignas(32) float sums[MR][kNR];
  alignas(32) float xf[MR][2 * kKc];  // this chunk's x values in fp32 (0 past an odd K)
  const int64_t K2 = (K + 1) / 2;
  if (K2 == 0) std::memset(sums, 0, sizeof(sums));
  const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  for (int64_t c0 = 0; c0 < K2; c0 += kKc) {
    const int64_t c1 = std::min(K2, c0 + kKc);
    const int64_t n = std::min(K, 2 * c1) - 2 * c0;  // x values of this chunk
    for (int r = 0; r < MR; ++r) {
      const uint16_t* xr = x + r * ldx + 2 * c0;
      for (int64_t i = 0; i < 2 * (c1 - c0); i += 8) {  // zero-extended, shifted to the high half
        alignas(16) uint16_t tail[8] = {};  // past the last x value: zeros
        const uint16_t* src = xr + i;
        if (i + 8 > n) {
          if (n > i) std::memcpy(tail, src, (n - i) * sizeof(uint16_t));
          src = tail;
        }
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
        _mm256_store_ps(&xf[r][i],
                        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
      }
    }
    for (int s = 0; s < NV; ++s) {
      __m256 acc[MR][2];
      load_strip<MR>(acc, sums, s, c0 == 0);
      for (int64_t c = c0; c < c1; ++c) {
        const uint16_t* b = w + c * kNR * 2 + s * 32;
        if (s == 0) prefetch_ahead(reinterpret_cast<const char*>(w), next, c, K2);
        const __m256i p0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
        const __m256i p1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
        const float* xe = &xf[0][2 * (c - c0)];
        {
          const __m256 b0 = _mm256_castsi256_ps(_mm256_slli_epi32(p0, 16));
          const __m256 b1 = _mm256_castsi256_ps(_mm256_slli_epi32(p1, 16));
          for (int r = 0; r < MR; ++r) {
            const __m256 a = _mm256_broadcast_ss(xe + r * 2 * kKc);
            acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
          }
        }
        {
          const __m256 b0 = _mm256_castsi256_ps(_mm256_and_si256(p0, high));
          const __m256 b1 = _mm256_castsi256_ps(_mm256_and_si256(p1, high));
          for (int r = 0; r < MR; ++r) {
            const __m256 a = _mm256_broadcast_ss(xe + r * 2 * kKc + 1);
            acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
          }
        }
      }
      park_strip<MR>(acc, sums, s);
    }
  }
  for (int r = 0; r < MR; ++r) store_row(o, row0 + r, col0, sums[r]);
}

}  // namespace pagedq_gemm
