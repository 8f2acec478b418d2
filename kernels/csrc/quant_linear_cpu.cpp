// Weight-only quantized projections y = x @ dequantize(W)^T + b over the packed layout of
// kernels/quant_linear.py (uint4, uint8 or fp8 e4m3 codes; fp32 scales and zero points per row
// and group of k), unpacked in registers: no dequantized copy of a layer is ever made.
//
// Decode (few rows of x): each thread streams its blocks of 16 output features once, and every
// unpacked weight vector meets all rows of x (a group of rows at a time, the others reuse the
// bytes from L1). Vectors run along k, so each (row, feature) ends as a vector of partial sums;
// a block's 16 of them per row are reduced together. Each group of k is summed, then scaled once.
// - bf16 x on AVX512-BF16: the codes become bf16 q - zero (integers up to 256 are bf16 numbers)
//   or e4m3 values, exact, and meet x in vdpbf16ps: fp32 products and sums, 32 per instruction.
// - otherwise (fp32 x, AVX2, fp8 with zero points): fp32 q - zero (uint4: q, its zero points
//   taken off as zero * the segment's sum of x) meet fp32 x in FMAs.
// Prefill (more rows): a pass of rows takes a 64-feature block tile by tile of k, unpacks each
// tile once into gemm_cpu.h's packed layout (fp32 (q - zero) * scale, the reference's own
// weights; bf16 q - zero with the group's scales applied to the sums) and runs its micro-kernels.
//
// Sums are fp32 and the output is rounded once, after the bias. The NaN codes of e4m3 (0x7F,
// 0xFF) read as 480: checkpoints hold no NaN weights.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gemm_cpu.h"
#include "vec_cpu.h"

namespace {

using namespace pagedq_vec;

enum : int64_t { kUint4 = 0, kUint8 = 1, kFp8 = 2 };  // kernels/quant_linear.py's codes

constexpr int64_t kRowBlock = 16;      // output features per decode block (one reduction)
constexpr int64_t kSpan = 2 * kLanes;  // k per step of the fp32 kernels
#if defined(__AVX512F__)
constexpr int kMaxRows = 8;            // rows of x per decode micro-kernel
constexpr int kSumRegs = 16;           // registers for its sums
constexpr int64_t kDecodeRows = 16;    // up to this many rows, the decode kernels
#else
// 16 registers: sums of 4 rows x 2 weight rows, 4 weight and 2 x vectors (groups of 8 rows,
// 8 x 1 sums with x reloaded per FMA, took 1.15x the time at 8-16 rows on an AVX2 EPYC).
constexpr int kMaxRows = 4;
constexpr int kSumRegs = 8;
constexpr int64_t kDecodeRows = 11;  // from 12 rows the prefill kernels were faster there
#endif
// Rows interleaved in a decode block defeat the hardware prefetcher: uint4 at one row read DRAM
// at 4 GB/s (1.6x its time from L3) until each row's own bytes were prefetched this far ahead.
constexpr int64_t kPrefetchAhead = 256;
constexpr int64_t kMinThreadWork = 1 << 18;  // multiply-adds per thread, at the least

// The packed weight as the kernels read it. Rows past N (a block's tail) read row N - 1:
// computed, never stored.
struct Weights {
  int64_t type;
  const uint8_t* q;
  int64_t ldq;  // bytes per row
  const float* scales;
  const float* zeros;  // nullptr: zero
  int64_t groups, group_size, N, K;

  int64_t clamp(int64_t n) const { return std::min(n, N - 1); }
  const uint8_t* row(int64_t n) const { return q + clamp(n) * ldq; }
  float scale(int64_t n, int64_t g) const { return scales[clamp(n) * groups + g]; }
  float zero(int64_t n, int64_t g) const { return zeros ? zeros[clamp(n) * groups + g] : 0.f; }
  int64_t bytes(int64_t k) const { return type == kUint4 ? k / 2 : k; }
  // Brings a row's bytes of k in [k0, k1), `ahead` bytes on, towards L1.
  void prefetch(const uint8_t* row, int64_t k0, int64_t k1, int64_t ahead) const {
    for (int64_t b = bytes(k0); b < bytes(k1); b += 64) __builtin_prefetch(row + b + ahead);
  }
};

// ---- codes to fp32 (every target: GCC vector extensions) ----

// kLanes bytes at p, zero-extended (GCC's __builtin_convertvector loads them one by one).
inline vint bytes_at(const uint8_t* p) {
#if defined(__AVX512F__)
  return (vint)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  return (vint)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  vint v;
  for (int i = 0; i < kLanes; ++i) v[i] = p[i];
  return v;
#endif
}
inline vfloat to_float(vint v) { return __builtin_convertvector(v, vfloat); }

// e4m3 codes as fp32, exactly and without denormal inputs: normals rebiased (7 -> 127),
// subnormals m * 2^-9.
inline vfloat fp8_to_float(vint b) {
  const vint normal = ((b & 0x7F) << 20) + (120 << 23);
  const vfloat sub = to_float(b & 7) * 0x1p-9f;
  const vfloat mag = (b & 0x78) == 0 ? sub : (vfloat)normal;
  return (vfloat)((vuint)mag | ((vuint)(b & 0x80) << 24));
}

// One row's kSpan codes from k as fp32 q - z (q without Zero), exact, in two vectors: positions
// 0..kLanes-1 and kLanes..kSpan-1 of the span. uint4 puts the even k first (the low nibbles),
// then the odd ones, and x is read in that order too (eo_split); the others keep k's order.
template <int64_t Type, bool Zero>
inline void span_values(const uint8_t* row, int64_t k, vfloat z, vfloat& w0, vfloat& w1) {
  if constexpr (Type == kUint4) {
    const vint b = bytes_at(row + k / 2);
    w0 = to_float(b & 0xF);
    w1 = to_float(b >> 4);
  } else if constexpr (Type == kUint8) {
    w0 = to_float(bytes_at(row + k));
    w1 = to_float(bytes_at(row + k + kLanes));
  } else {
    w0 = fp8_to_float(bytes_at(row + k));
    w1 = fp8_to_float(bytes_at(row + k + kLanes));
  }
  if constexpr (Zero) {
    w0 -= z;
    w1 -= z;
  }
}

// ---- decode ----

// Where feature i of a block keeps its partial sums: hsum16 leaves slot s's total in lane
// (s % 4) * 4 + s / 4, so feature i goes to the slot whose total lands in lane i.
inline int slot_of(int64_t i) {
#if defined(__AVX512F__)
  return static_cast<int>((i >> 2) | ((i & 3) << 2));
#else
  return static_cast<int>(i);
#endif
}

// The segments of k in [k0, k1), multiples of seg: a segment is a group, or an equal part of
// one; the loops count them without divisions.
struct Segments {
  int64_t seg, per_group, start, end, index, group, part;

  Segments(int64_t seg_, int64_t group_size, int64_t k0, int64_t k1)
      : seg(seg_), per_group(group_size / seg_), start(k0), end(k1), index(k0 / seg_),
        group(index / per_group), part(index % per_group) {}
  bool done() const { return start >= end; }
  void next() {
    start += seg;
    ++index;
    if (++part == per_group) {
      part = 0;
      ++group;
    }
  }
};

// What the decode micro-kernels share for a group of rows of x.
struct DecodeRows {
  const void* x;  // fp32 in span order, or bf16
  int64_t ldx;
  // uint4 on fp32 with zero points: per row, segment and lane, the sum of the x values the
  // lane meets in the segment; else nullptr.
  const float* xsum;
  int64_t segments;
  float* lanes;  // the rows' partial sums: [rows][kRowBlock slots][kLanes]
  float* lane(int m, int64_t i) const { return lanes + (m * kRowBlock + slot_of(i)) * kLanes; }
};

// MB rows of x against NR weight rows from feature n (block position i0) over k in [k0, k1);
// each segment's sums, scaled, go into the lanes (set by the block's first segment).
template <int64_t Type, int MB, int NR>
void decode_fp32(const Weights& w, const DecodeRows& d, int64_t seg, int64_t n, int64_t i0,
                 int64_t k0, int64_t k1, bool first) {
  // Two sums per row pair (a span's halves) where registers allow: one chain of dependent FMAs
  // per step instead of two, which one row of x waited on.
  constexpr int S = MB * NR * 2 <= kSumRegs ? 2 : 1;
  const float* x = static_cast<const float*>(d.x);
  const uint8_t* rows[NR];
  const float *scales[NR], *zeros[NR];
  for (int r = 0; r < NR; ++r) {
    rows[r] = w.row(n + r);
    scales[r] = w.scales + w.clamp(n + r) * w.groups;
    zeros[r] = w.zeros ? w.zeros + w.clamp(n + r) * w.groups : nullptr;
  }
  vfloat z[NR], acc[MB][NR][S];
  for (Segments s(seg, w.group_size, k0, k1); !s.done(); s.next()) {
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      z[r] = vfloat{} + (zeros[r] ? zeros[r][s.group] : 0.f);
      w.prefetch(rows[r], s.start, s.start + seg, kPrefetchAhead);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m)
        for (int h = 0; h < S; ++h) acc[m][r][h] = vfloat{};
    }
    for (int64_t k = s.start; k < s.start + seg; k += kSpan) {
      vfloat w0[NR], w1[NR];
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) span_values<Type, Type != kUint4>(rows[r], k, z[r], w0[r], w1[r]);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const vfloat x0 = loadv(x + m * d.ldx + k), x1 = loadv(x + m * d.ldx + k + kLanes);
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) {
          acc[m][r][0] += x0 * w0[r];
          acc[m][r][S - 1] += x1 * w1[r];
        }
      }
    }
    const bool set = first && s.start == k0;
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const vfloat scale = vfloat{} + scales[r][s.group];
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        vfloat sum = S == 2 ? acc[m][r][0] + acc[m][r][S - 1] : acc[m][r][0];
        if (Type == kUint4 && d.xsum)
          sum -= z[r] * loadv(d.xsum + (m * d.segments + s.index) * kLanes);
        float* lane = d.lane(m, i0 + r);
        storev(lane, set ? sum * scale : loadv(lane) + sum * scale);
      }
    }
  }
}

#if defined(__AVX512BF16__)

// One row's 32 codes from k as bf16 pairs (k 2j and 2j + 1 in dword j, x's own order): the
// integers q - zero, or the e4m3 values, all exact in bf16. `aux` is the row's table of
// 16 - zero values (uint4), its zero point (uint8, as floats) or the subnormal table (fp8).
template <int64_t Type>
inline __m512i span_bf16(const uint8_t* row, int64_t k, __m512i aux) {
  if constexpr (Type == kUint4) {
    const __m512i d =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2)));
    // Word 2j: the low nibble of byte j, word 2j + 1: the high one ((d | d << 12) & 0x000F000F).
    const __m512i idx = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12),
                                                  _mm512_set1_epi32(0x000F000F), 0xA8);
    return _mm512_permutexvar_epi16(idx, aux);
  } else if constexpr (Type == kUint8) {
    const __m512 z = _mm512_castsi512_ps(aux);
    const __m128i* p = reinterpret_cast<const __m128i*>(row + k);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p + 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(hi, z), _mm512_sub_ps(lo, z));
  } else {
    const __m512i b =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k)));
    // e4m3 -> bf16: the exponent rebiased (+120) for normals; subnormals (exponent 0) from the
    // table, as bf16 normals (vdpbf16ps reads bf16 subnormals as zero); then the sign.
    __m512i v = _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x7F)), 4);
    v = _mm512_add_epi16(v, _mm512_set1_epi16(0x3C00));
    v = _mm512_mask_permutexvar_epi16(v, _mm512_testn_epi16_mask(b, _mm512_set1_epi16(0x78)), b,
                                      aux);
    return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(b, 8),
                                     _mm512_set1_epi16(int16_t(0x8000)), 0xF8);  // v | b << 8 & sign
  }
}

// A row's `aux` for span_bf16 in group g.
template <int64_t Type>
inline __m512i aux_of(const Weights& w, int64_t n, int64_t g) {
  if constexpr (Type == kUint4) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 v = _mm512_sub_ps(iota, _mm512_set1_ps(w.zero(n, g)));
    return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(v));
  } else if constexpr (Type == kUint8) {
    return _mm512_castps_si512(_mm512_set1_ps(w.zero(n, g)));
  } else {
    // m * 2^-9 as bf16 for m = 0..7 (the index's bits 3-4 are the exponent's, zero here).
    alignas(64) static const uint16_t table[32] = {0,      0x3B00, 0x3B80, 0x3BC0,
                                                   0x3C00, 0x3C20, 0x3C40, 0x3C60};
    return _mm512_load_si512(table);
  }
}

// decode_fp32's twin for bf16 x: vdpbf16ps over each segment, then its scale.
template <int64_t Type, int MB, int NR>
void decode_bf16(const Weights& w, const DecodeRows& d, int64_t seg, int64_t n, int64_t i0,
                 int64_t k0, int64_t k1, bool first) {
  const uint16_t* x = static_cast<const uint16_t*>(d.x);
  const uint8_t* rows[NR];
  for (int r = 0; r < NR; ++r) rows[r] = w.row(n + r);
  __m512i aux[NR];
  __m512 acc[MB][NR];
  for (Segments s(seg, w.group_size, k0, k1); !s.done(); s.next()) {
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      aux[r] = aux_of<Type>(w, n + r, s.group);
      w.prefetch(rows[r], s.start, s.start + seg, kPrefetchAhead);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) acc[m][r] = _mm512_setzero_ps();
    }
    for (int64_t k = s.start; k < s.start + seg; k += 32) {
      __m512bh wv[NR];
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) wv[r] = (__m512bh)span_bf16<Type>(rows[r], k, aux[r]);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * d.ldx + k);
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
      }
    }
    const bool set = first && s.start == k0;
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const __m512 scale = _mm512_set1_ps(w.scale(n + r, s.group));
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        float* lane = d.lane(m, i0 + r);
        _mm512_storeu_ps(lane, set ? _mm512_mul_ps(acc[m][r], scale)
                                   : _mm512_fmadd_ps(acc[m][r], scale, _mm512_loadu_ps(lane)));
      }
    }
  }
}

#endif  // __AVX512BF16__

#if defined(__AVX512F__)
// Lane l of the result: the sum of the 16 floats of vector (l % 4) * 4 + l / 4 at t (slot_of).
inline __m512 hsum16(const float* t) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 u = _mm512_loadu_ps(t + 32 * i), v = _mm512_loadu_ps(t + 32 * i + 16);
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u, v, 0x44), _mm512_shuffle_f32x4(u, v, 0xEE));
  }
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
}
#endif

// Where the output goes: [M, N] fp32 or bf16, plus the bias.
struct Out {
  void* base;
  bool fp32;
  const float* bias;  // nullptr or [N]
  int64_t N;

  // `count` sums of row m from feature n0: the bias added, rounded once.
  void store(int64_t m, int64_t n0, const float* v, int64_t count) const {
    for (int64_t i = 0; i < count; ++i) {
      const float y = v[i] + (bias ? bias[n0 + i] : 0.f);
      if (fp32) {
        static_cast<float*>(base)[m * N + n0 + i] = y;
      } else {
        static_cast<c10::BFloat16*>(base)[m * N + n0 + i] = c10::BFloat16(y);
      }
    }
  }
};

// Weight rows per decode micro-kernel: more where x has few rows, for enough sums in flight.
constexpr int rows_for(int mb) { return mb <= 2 ? 4 : 2; }

// A block's 16 features against a group of `MB` rows of x.
template <int64_t Type, bool Bf16, int MB>
void decode_block(const Weights& w, const DecodeRows& d, int64_t seg, int64_t n, int64_t k0,
                  int64_t k1, bool first) {
  constexpr int NR = rows_for(MB);
  for (int64_t r = 0; r < kRowBlock; r += NR) {
#if defined(__AVX512BF16__)
    if constexpr (Bf16) {
      decode_bf16<Type, MB, NR>(w, d, seg, n + r, r, k0, k1, first);
      continue;
    }
#endif
    decode_fp32<Type, MB, NR>(w, d, seg, n + r, r, k0, k1, first);
  }
}

template <int64_t Type, bool Bf16>
void decode_rows(int mb, const Weights& w, const DecodeRows& d, int64_t seg, int64_t n,
                 int64_t k0, int64_t k1, bool first) {
  switch (mb) {
    case 1: return decode_block<Type, Bf16, 1>(w, d, seg, n, k0, k1, first);
    case 2: return decode_block<Type, Bf16, 2>(w, d, seg, n, k0, k1, first);
    case 3: return decode_block<Type, Bf16, 3>(w, d, seg, n, k0, k1, first);
    case 4: return decode_block<Type, Bf16, 4>(w, d, seg, n, k0, k1, first);
#if defined(__AVX512F__)
    case 5: return decode_block<Type, Bf16, 5>(w, d, seg, n, k0, k1, first);
    case 6: return decode_block<Type, Bf16, 6>(w, d, seg, n, k0, k1, first);
    case 7: return decode_block<Type, Bf16, 7>(w, d, seg, n, k0, k1, first);
    case 8: return decode_block<Type, Bf16, 8>(w, d, seg, n, k0, k1, first);
#endif
    default: return;
  }
}

// Per row of fp32 x (span order) and segment: per lane, the sum of the x values the lane meets.
std::vector<float> segment_sums(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t seg) {
  std::vector<float> sums(M * (K / seg) * kLanes);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < K / seg; ++j) {
      vfloat acc{};
      for (int64_t k = j * seg; k < (j + 1) * seg; k += kSpan)
        acc += loadv(x + m * ldx + k) + loadv(x + m * ldx + k + kLanes);
      storev(sums.data() + (m * (K / seg) + j) * kLanes, acc);
    }
  return sums;
}

// Threads take runs of 16-feature blocks; a block goes over k in chunks whose x rows stay in L1
// (chunks of whole segments), and each chunk of a weight row meets every group of rows of x
// while in L1.
template <int64_t Type, bool Bf16>
void run_decode(const Weights& w, const void* x, int64_t ldx, int64_t M, const Out& out) {
  const int64_t NB = (w.N + kRowBlock - 1) / kRowBlock, elem = Bf16 ? 2 : 4;
  const int64_t target = std::max<int64_t>(256, 16384 / elem / std::min(M, kDecodeRows) / 32 * 32);
  int64_t seg = w.group_size;
  for (int64_t parts = 2; seg > target; ++parts)
    if (w.group_size % parts == 0 && (w.group_size / parts) % 32 == 0) seg = w.group_size / parts;
  const int64_t chunk = std::max(seg, target / seg * seg), segments = w.K / seg;
  std::vector<float> xsum;
  if (!Bf16 && Type == kUint4 && w.zeros)
    xsum = segment_sums(static_cast<const float*>(x), ldx, M, w.K, seg);
  const int64_t row_groups = (M + kMaxRows - 1) / kMaxRows;
  // Small layers on one thread: waking the others cost more than their share of the work.
  const int64_t grain = std::max<int64_t>(1, kMinThreadWork / (kRowBlock * w.K * M));
  at::parallel_for(0, NB, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> lanes(M * kRowBlock * kLanes);
    alignas(64) float sums[kRowBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kRowBlock;
      for (int64_t k0 = 0; k0 < w.K; k0 += chunk) {
        for (int64_t m0 = 0, j = 0; j < row_groups; ++j) {
          const int64_t m1 = m0 + (M - m0) / (row_groups - j);  // near-equal groups of rows
          const DecodeRows d{static_cast<const char*>(x) + m0 * ldx * elem, ldx,
                             xsum.empty() ? nullptr : xsum.data() + m0 * segments * kLanes,
                             segments, lanes.data() + m0 * kRowBlock * kLanes};
          decode_rows<Type, Bf16>(static_cast<int>(m1 - m0), w, d, seg, n0, k0,
                                  std::min(w.K, k0 + chunk), k0 == 0);
          m0 = m1;
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        const float* t = lanes.data() + m * kRowBlock * kLanes;
#if defined(__AVX512F__)
        _mm512_store_ps(sums, hsum16(t));
#else
        for (int64_t i = 0; i < kRowBlock; ++i) sums[i] = sum_lanes(loadv(t + i * kLanes));
#endif
        out.store(m, n0, sums, std::min(kRowBlock, w.N - n0));
      }
    }
  });
}

// ---- prefill: tiles in gemm_cpu.h's layout, its micro-kernels over them ----

#if defined(PAGEDQ_GEMM_FP32)

using pagedq_gemm::kMR;
using pagedq_gemm::kNR;

constexpr int64_t kPassRows = 256;  // rows per pass over the weights
constexpr int64_t kTileK = 128;     // k per fp32 tile (32 KB)

// The micro-kernels' sums over one tile, added into the pass's fp32 sums [rows][64]; times the
// group's scale per feature where given (bf16 tiles hold q - zero).
struct TileOut {
  float* acc;
  int64_t row0;
  const float* scale;  // nullptr or 64
  bool first;
};

#if defined(__AVX512F__)
inline void store_row(const TileOut& o, int64_t row, int64_t, const __m512* acc) {
  float* dst = o.acc + (row - o.row0) * kNR;
  for (int j = 0; j < 4; ++j) {
    __m512 v = acc[j];
    if (o.scale) {
      const __m512 s = _mm512_loadu_ps(o.scale + 16 * j);
      v = o.first ? _mm512_mul_ps(v, s) : _mm512_fmadd_ps(v, s, _mm512_loadu_ps(dst + 16 * j));
    } else if (!o.first) {
      v = _mm512_add_ps(v, _mm512_loadu_ps(dst + 16 * j));
    }
    _mm512_storeu_ps(dst + 16 * j, v);
  }
}
#else
inline void store_row(const TileOut& o, int64_t row, int64_t, const float* sums) {
  float* dst = o.acc + (row - o.row0) * kNR;
  for (int64_t j = 0; j < kNR; j += kLanes) {
    vfloat v = loadv(sums + j);
    if (o.scale) v *= loadv(o.scale + j);
    storev(dst + j, o.first ? v : v + loadv(dst + j));
  }
}
#endif

// t[0..kLanes) transposed in place: lane r of t[p] <- lane p of t[r].
inline void transpose_lanes(vfloat* t) {
  float* f = reinterpret_cast<float*>(t);
#if defined(__AVX512F__)
  __m512 r[16], a[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(f + 16 * i);
  for (int i = 0; i < 16; i += 2) {
    a[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    a[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(a[i], a[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(a[i], a[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(a[i + 1], a[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(a[i + 1], a[i + 3], 0xEE);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      a[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
      a[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    _mm512_storeu_ps(f + 16 * j, _mm512_shuffle_f32x4(a[j], a[j + 8], 0x88));
    _mm512_storeu_ps(f + 16 * (j + 8), _mm512_shuffle_f32x4(a[j], a[j + 8], 0xDD));
  }
#elif defined(__AVX2__)
  __m256 r[8], a[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(f + 8 * i);
  for (int i = 0; i < 8; i += 2) {
    a[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    a[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(a[i], a[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(a[i], a[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(a[i + 1], a[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(a[i + 1], a[i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    _mm256_storeu_ps(f + 8 * j, _mm256_permute2f128_ps(r[j], r[j + 4], 0x20));
    _mm256_storeu_ps(f + 8 * (j + 4), _mm256_permute2f128_ps(r[j], r[j + 4], 0x31));
  }
#else
  for (int i = 0; i < kLanes; ++i)
    for (int j = i + 1; j < kLanes; ++j) std::swap(f[i * kLanes + j], f[j * kLanes + i]);
#endif
}

// Features [n0, n0 + 64) over k in [k0, k0 + kc) as fp32 [kc][64]: the reference's weights
// (q - z) * s, k in span order, zero past N.
template <int64_t Type>
void tile_fp32(const Weights& w, int64_t n0, int64_t k0, int64_t kc, float* tile) {
  for (int64_t i0 = 0; i0 < kNR; i0 += kLanes) {
    const uint8_t* rows[kLanes];
    for (int r = 0; r < kLanes; ++r) rows[r] = w.row(n0 + i0 + r);
    for (int64_t k = k0; k < k0 + kc;) {
      const int64_t g = k / w.group_size, end = std::min(k0 + kc, (g + 1) * w.group_size);
      float z[kLanes], s[kLanes];
      for (int r = 0; r < kLanes; ++r) {
        z[r] = w.zero(n0 + i0 + r, g);
        s[r] = n0 + i0 + r < w.N ? w.scale(n0 + i0 + r, g) : 0.f;
      }
      for (; k < end; k += kSpan) {
        vfloat v0[kLanes], v1[kLanes];
        for (int r = 0; r < kLanes; ++r) {
          span_values<Type, true>(rows[r], k, vfloat{} + z[r], v0[r], v1[r]);
          v0[r] *= s[r];
          v1[r] *= s[r];
        }
        transpose_lanes(v0);
        transpose_lanes(v1);
        for (int p = 0; p < kLanes; ++p) {
          storev(tile + (k - k0 + p) * kNR + i0, v0[p]);
          storev(tile + (k - k0 + kLanes + p) * kNR + i0, v1[p]);
        }
      }
    }
  }
}

#if defined(__AVX512BF16__)
// The bf16 twin: q - zero (or the fp8 values) as [kc / 2][64] k-pairs, all k in group g, and
// the group's scale per feature into `scale` (zero past N).
template <int64_t Type>
void tile_bf16(const Weights& w, int64_t n0, int64_t k0, int64_t kc, int64_t g, uint32_t* tile,
               float* scale) {
  for (int64_t i0 = 0; i0 < kNR; i0 += 16) {
    __m512i aux[16];
    for (int r = 0; r < 16; ++r) {
      aux[r] = aux_of<Type>(w, n0 + i0 + r, g);
      scale[i0 + r] = n0 + i0 + r < w.N ? w.scale(n0 + i0 + r, g) : 0.f;
    }
    for (int64_t k = k0; k < k0 + kc; k += 32) {
      vfloat v[16];
      for (int r = 0; r < 16; ++r) {
        v[r] = (vfloat)span_bf16<Type>(w.row(n0 + i0 + r), k, aux[r]);
      }
      transpose_lanes(v);
      for (int p = 0; p < 16; ++p)
        storev(reinterpret_cast<float*>(tile) + ((k - k0) / 2 + p) * kNR + i0, v[p]);
    }
  }
}
#endif

// As linear_cpu.cpp: more passes over the rows where that spreads the tasks evenly.
inline int64_t row_passes(int64_t M, int64_t units, int64_t threads) {
  const int64_t base = (M + kPassRows - 1) / kPassRows;
  for (int64_t passes = base; passes < base + threads; ++passes)
    if ((passes * units) % threads == 0) return passes;
  return base;
}

// Tasks of (row pass, 64-feature block): each tile of k is unpacked once per task and met by
// all its rows in micro-kernels of 6, while the next tile's codes are prefetched.
template <int64_t Type, bool Bf16>
void run_prefill(const Weights& w, const void* x, int64_t ldx, int64_t M, const Out& out) {
  const int64_t NB = (w.N + kNR - 1) / kNR;
  const int64_t passes = row_passes(M, NB, at::get_num_threads());
  const int64_t rows = (M + passes - 1) / passes;
  // bf16 tiles hold whole groups or equal parts of one (a tile's sums take one scale).
  int64_t kc = kTileK;
  if (Bf16) {
    kc = w.group_size;
    for (int64_t parts = 2; kc > 256; ++parts)
      if (w.group_size % parts == 0 && (w.group_size / parts) % 32 == 0) kc = w.group_size / parts;
  }
  const int64_t grain = std::max<int64_t>(1, kMinThreadWork / (rows * kNR * w.K));
  at::parallel_for(0, passes * NB, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(rows * kNR), tile(std::max(kc, kTileK) * kNR);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nb = t % NB, m0 = t / NB * rows, m1 = std::min(M, m0 + rows), n0 = nb * kNR;
      if (m0 >= m1) continue;
      for (int64_t k0 = 0; k0 < w.K; k0 += kc) {
        const int64_t kk = std::min(kc, w.K - k0);
        for (int64_t i = 0; i < kNR; ++i) {  // the next tile's codes, or the next task's first
          if (k0 + kk < w.K) {
            w.prefetch(w.row(n0 + i), k0 + kk, std::min(w.K, k0 + kk + kc), 0);
          } else {
            w.prefetch(w.row((nb + 1) % NB * kNR + i), 0, std::min(w.K, kc), 0);
          }
        }
        TileOut o{acc.data(), m0, nullptr, k0 == 0};
#if defined(__AVX512BF16__)
        if constexpr (Bf16) {
          alignas(64) float scale[kNR];
          tile_bf16<Type>(w, n0, k0, kk, k0 / w.group_size,
                          reinterpret_cast<uint32_t*>(tile.data()), scale);
          o.scale = scale;
          const uint16_t* xb = static_cast<const uint16_t*>(x) + k0;
          const uint16_t* wb = reinterpret_cast<const uint16_t*>(tile.data());
          for (int64_t m = m0; m < m1; m += kMR)
            pagedq_gemm::micro_rows<uint16_t, pagedq_gemm::Bf16Kernel, 4>(
                static_cast<int>(std::min<int64_t>(kMR, m1 - m)), xb, ldx, wb, kk, nullptr, o,
                m, 0);
          continue;
        }
#endif
        tile_fp32<Type>(w, n0, k0, kk, tile.data());
        const float* xf = static_cast<const float*>(x) + k0;
        for (int64_t m = m0; m < m1; m += kMR)
          pagedq_gemm::micro_rows<float, pagedq_gemm::Fp32Kernel, 4>(
              static_cast<int>(std::min<int64_t>(kMR, m1 - m)), xf, ldx, tile.data(), kk,
              nullptr, o, m, 0);
      }
      for (int64_t m = m0; m < m1; ++m)
        out.store(m, n0, acc.data() + (m - m0) * kNR, std::min(kNR, w.N - n0));
    }
  });
}

#endif  // PAGEDQ_GEMM_FP32

template <int64_t Type, bool Bf16>
void run(const Weights& w, const void* x, int64_t ldx, int64_t M, const Out& out) {
#if defined(PAGEDQ_GEMM_FP32)
  if (M > kDecodeRows) return run_prefill<Type, Bf16>(w, x, ldx, M, out);
#endif
  run_decode<Type, Bf16>(w, x, ldx, M, out);  // every M where the micro-kernels are not built
}

bool quant_linear_available() { return true; }

void quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                  const c10::optional<at::Tensor>& zeros, int64_t weight_type, int64_t group_size,
                  const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  TORCH_CHECK(weight_type >= kUint4 && weight_type <= kFp8, "quant_linear: weight_type ",
              weight_type, " is not 0 (uint4), 1 (uint8) or 2 (float8_e4m3fn)");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1,
              "quant_linear: x must be [tokens, in], rows contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_linear: x must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.element_size() == 1 &&
                  qweight.size(1) == (weight_type == kUint4 ? K / 2 : K),
              "quant_linear: qweight must be contiguous bytes [out, ",
              weight_type == kUint4 ? "in / 2]" : "in]");
  TORCH_CHECK(K % 32 == 0 && group_size > 0 && group_size % 32 == 0 && K % group_size == 0,
              "quant_linear: in and group_size must be multiples of 32, in of group_size");
  const int64_t groups = K / group_size;
  auto check_groups = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 &&
                    t.size(0) == N && t.size(1) == groups,
                "quant_linear: ", name, " must be contiguous fp32 [out, in / group_size]");
  };
  check_groups(scales, "scales");
  const bool has_zeros = zeros.has_value() && zeros->defined();
  if (has_zeros) check_groups(*zeros, "zeros");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "quant_linear: bias must be contiguous fp32 [out]");
    b = bias->data_ptr<float>();
  }
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == M && out.size(1) == N &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "quant_linear: out must be contiguous fp32 or bf16 [tokens, out]");
  if (M == 0 || N == 0) return;
  const Weights w{weight_type, static_cast<const uint8_t*>(qweight.data_ptr()), qweight.size(1),
                  scales.data_ptr<float>(), has_zeros ? zeros->data_ptr<float>() : nullptr,
                  groups, group_size, N, K};
  const Out o{out.data_ptr(), out.scalar_type() == at::kFloat, b, N};
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16 && !(weight_type == kFp8 && has_zeros)) {
    const void* xb = x.data_ptr();
    if (weight_type == kUint4) return run<kUint4, true>(w, xb, x.stride(0), M, o);
    if (weight_type == kUint8) return run<kUint8, true>(w, xb, x.stride(0), M, o);
    return run<kFp8, true>(w, xb, x.stride(0), M, o);
  }
#endif
  // fp32 x in the codes' span order: a copy unless x already is.
  at::Tensor xs = x;
  if (x.scalar_type() != at::kFloat) {
    xs = x.to(at::kFloat).contiguous();
  } else if (weight_type == kUint4) {
    xs = x.clone(at::MemoryFormat::Contiguous);
  }
  if (weight_type == kUint4) {
    float* p = xs.data_ptr<float>();
    at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
      eo_split(p + m0 * K, static_cast<int>(m1 - m0), static_cast<int>(K));
    });
  }
  const void* xf = xs.data_ptr();
  if (weight_type == kUint4) return run<kUint4, false>(w, xf, xs.stride(0), M, o);
  if (weight_type == kUint8) return run<kUint8, false>(w, xf, xs.stride(0), M, o);
  run<kFp8, false>(w, xf, xs.stride(0), M, o);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedq, m) {
  m.def("quant_linear_available() -> bool", &quant_linear_available);
  m.def(
      "quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, int weight_type, "
      "int group_size, Tensor? bias, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pagedq, CPU, m) { m.impl("quant_linear", &quant_linear); }
