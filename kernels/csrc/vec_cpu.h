// Vectors of the target's native width for pagedq's CPU kernels: GCC/Clang vector extensions,
// 16 floats with AVX-512 and 8 otherwise (vectors wider than the registers spill: on an AVX2
// host a 16-wide attention ran 3-6x slower than an 8-wide one).
#pragma once

#include <cstdint>

namespace pagedq_vec {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vfloat __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef int32_t vint __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef uint32_t vuint __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef uint16_t vhalf __attribute__((vector_size(kLanes * 2), aligned(2)));

// Loads and stores through may_alias types of element alignment: plain vector moves. (A memcpy
// into a vector went through the stack on GCC 12 for znver3, a store-forwarding stall per load
// that made the attention 5x slower.)
typedef float vfloat_u __attribute__((vector_size(kLanes * 4), aligned(4), may_alias));
typedef uint16_t vhalf_u __attribute__((vector_size(kLanes * 2), aligned(2), may_alias));

inline vfloat loadv(const float* p) { return *reinterpret_cast<const vfloat_u*>(p); }
inline void storev(float* p, vfloat v) { *reinterpret_cast<vfloat_u*>(p) = v; }

// bf16 is the high half of an fp32: widening is a shift; narrowing rounds to nearest even
// (NaN kept quiet), as c10::BFloat16 does.
inline vfloat widen_bf16(const uint16_t* p) {
  const vhalf h = *reinterpret_cast<const vhalf_u*>(p);
  const vuint bits = __builtin_convertvector(h, vuint) << 16;
  return reinterpret_cast<const vfloat&>(bits);
}
inline void narrow_bf16(uint16_t* p, vfloat v) {
  const vuint bits = reinterpret_cast<const vuint&>(v);
  const vuint rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;
  const vint is_nan = (bits & 0x7FFFFFFF) > 0x7F800000;
  const vuint out = is_nan ? ((bits >> 16) | 0x40) : rounded;
  *reinterpret_cast<vhalf_u*>(p) = __builtin_convertvector(out, vhalf);
}

// v rounded to bf16's precision and kept in fp32 (the value a bf16 output holds), by the rule
// of narrow_bf16.
inline vfloat round_bf16(vfloat v) {
  const vuint bits = reinterpret_cast<const vuint&>(v);
  const vuint rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000u;
  const vint is_nan = (bits & 0x7FFFFFFF) > 0x7F800000;
  const vuint out = is_nan ? ((bits | 0x400000) & 0xFFFF0000u) : rounded;
  return reinterpret_cast<const vfloat&>(out);
}

// The 2 * kLanes bf16 values at p as two exact fp32 vectors: a vector of kLanes 32-bit lanes
// holds the even elements in its low halves and the odd ones in its high halves, so a shift and
// a mask widen both (one op per kLanes values, against a zero-extending shuffle and a shift).
// Dot products do not care about the order if both sides share it (eo_split); sums over keys
// of such vectors are put back in order with eo_interleave.
typedef uint32_t vuint_u __attribute__((vector_size(kLanes * 4), aligned(2), may_alias));
inline void widen_bf16_pairs(const uint16_t* p, vfloat& even, vfloat& odd) {
  const vuint bits = *reinterpret_cast<const vuint_u*>(p);
  const vuint e = bits << 16;
  const vuint o = bits & 0xFFFF0000u;
  even = reinterpret_cast<const vfloat&>(e);
  odd = reinterpret_cast<const vfloat&>(o);
}

// rows x D floats (D a multiple of 2 * kLanes), each 2 * kLanes chunk from element order to
// [evens, odds], in place; eo_interleave is its inverse.
inline void eo_split(float* x, int rows, int D) {
  float tmp[2 * kLanes];
  for (int i = 0; i < rows * D; i += 2 * kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      tmp[l] = x[i + 2 * l];
      tmp[kLanes + l] = x[i + 2 * l + 1];
    }
    for (int l = 0; l < 2 * kLanes; ++l) x[i + l] = tmp[l];
  }
}
inline void eo_interleave(float* x, int rows, int D) {
  float tmp[2 * kLanes];
  for (int i = 0; i < rows * D; i += 2 * kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      tmp[2 * l] = x[i + l];
      tmp[2 * l + 1] = x[i + kLanes + l];
    }
    for (int l = 0; l < 2 * kLanes; ++l) x[i + l] = tmp[l];
  }
}

// e^r for |r| <= ln(2) / 2, on a float or on every lane of a vfloat: a degree-7 Taylor
// polynomial (relative error < 1e-8 there).
template <typename V>
inline V exp_taylor(V r) {
  V p = r * 0.f + 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  return p * r + 1.f;
}

// 2^n for integral n in [-126, 127], as the float's exponent bits.
inline vfloat pow2_int(vfloat n) {
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  return reinterpret_cast<const vfloat&>(bits);
}

// 1.5 * 2^23: adding it and taking it away rounds a float to the nearest integer.
constexpr float kRoundMagic = 12582912.f;

// 2^x on every lane for x <= 0 (x = -inf gives 0).
inline vfloat exp2_neg_v(vfloat x) {
  const vfloat clamped = x < -125.f ? vfloat{} - 125.f : x;
  const vfloat n = (clamped + kRoundMagic) - kRoundMagic;
  const vfloat r = exp_taylor((clamped - n) * 0.6931471805599453f) * pow2_int(n);
  return x <= -125.f ? vfloat{} : r;
}

// e^x on every lane: n = round(x / ln 2), r = x - n ln 2 in two parts (Cody-Waite, so that r
// keeps its precision for large |x|), e^r times 2^n. x is clamped to [-87, 88] (e^x stays a
// normal float); relative error about 1e-7, like Sleef's.
inline vfloat exp_v(vfloat x) {
  x = x < -87.f ? vfloat{} - 87.f : x;
  x = x > 88.f ? vfloat{} + 88.f : x;
  const vfloat n = (x * 1.4426950408889634f + kRoundMagic) - kRoundMagic;
  const vfloat r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  return exp_taylor(r) * pow2_int(n);
}

inline float sum_lanes(vfloat v) {
  float s = 0.f;
  for (int j = 0; j < kLanes; ++j) s += v[j];
  return s;
}

}  // namespace pagedq_vec
