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

// 2^x on every lane for x <= 0 (x = -inf gives 0): round to nearest, then a degree-7 Taylor
// polynomial on [-0.5, 0.5] (relative error < 1e-8).
inline vfloat exp2_neg_v(vfloat x) {
  const vfloat clamped = x < -125.f ? vfloat{} - 125.f : x;
  const vfloat magic = vfloat{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const vfloat n = (clamped + magic) - magic;
  const vfloat f = (clamped - n) * 0.6931471805599453f;
  vfloat p = vfloat{} + 1.f / 5040.f;
  p = p * f + 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  const vfloat r = p * reinterpret_cast<const vfloat&>(bits);
  return x <= -125.f ? vfloat{} : r;
}

inline float sum_lanes(vfloat v) {
  float s = 0.f;
  for (int j = 0; j < kLanes; ++j) s += v[j];
  return s;
}

}  // namespace pagedq_vec
