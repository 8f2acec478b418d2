// The AMX tile GEMM over gemm_cpu.h's packed bf16 weights, for row counts where the products,
// not the weight stream, bound the time (a prefill's experts: 2048 tokens x top-8 of 64 give
// each expert 256 rows, where AVX512-BF16 ran at 0.2 TFLOP/s and oneDNN's AMX at 1).
//
// The packed layout is already the tile unit's: a column block's k-pair row holds 64 columns
// of (k, k + 1) pairs, 256 bytes, so a B tile (16 k-pairs x 16 columns) is a tile load at a
// 256-byte stride, with no repacking. Rows go 16 at a time (one A tile of 16 rows x 32 k);
// the sums of 16 rows x NV * 16 columns stay in NV C tiles over the whole K, then go through
// the caller's epilogue (store_row, as the AVX micro-kernels call it) a row at a time.
#pragma once

#include "amx_cpu.h"
#include "gemm_cpu.h"

#if defined(PAGEDQ_AMX)

namespace pagedq_gemm {

constexpr int kAmxRows = 16;  // rows of an A and a C tile
constexpr int kAmxK = 32;     // bf16 k values of an A tile row (64 bytes)

// Tiles 0-3: C (16 rows x 16 fp32), 4: A (16 rows x 32 bf16), 5-6: B (16 k-pairs x 32 bf16),
// loaded in turns so that one loads while the other multiplies.
inline void amx_gemm_configure() {
  alignas(64) pagedq_amx::TileConfig c{};
  c.palette_id = 1;
  for (int t = 0; t < 7; ++t) {
    c.rows[t] = kAmxRows;
    c.colsb[t] = 64;
  }
  PQ_MEMORY_BARRIER();
  _tile_loadconfig(&c);
}

// True where amx_rows runs this product: AMX here and allowed, K a whole number of A tiles.
inline bool amx_gemm_usable(int64_t K) { return K % kAmxK == 0 && pagedq_amx::amx_enabled(); }

#define PQ_AMX_STEP(J, B)                                                       \
  if constexpr (NV > J) {                                                       \
    _tile_loadd(B, b + J * 32, kNR * 4);                                        \
    _tile_dpbf16ps(J, 4, B);                                                    \
  }

// Rows [m, m + 16) of x (bf16, row stride ldx; rows past the caller's `rows` are read but their
// sums are dropped, so x must have 16 readable rows from m) against the NV * 16 columns of one
// packed block from `w` (K a multiple of 32). Rows m .. m + rows - 1 go to store_row(o, ...).
// The thread must have called amx_gemm_configure.
template <int NV, class O>
void amx_rows(int rows, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, const O& o,
              int64_t m, int64_t col0) {
  static_assert(NV == 2 || NV == 4, "amx_rows takes 2 or 4 column tiles");
  alignas(64) float c[kAmxRows * kNR];
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (NV > 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const uint16_t* a = x + m * ldx;
  PQ_MEMORY_BARRIER();
  for (int64_t k = 0; k < K; k += kAmxK) {
    _tile_loadd(4, a + k, ldx * 2);
    const uint16_t* b = w + k / 2 * kNR * 2;
    PQ_AMX_STEP(0, 5)
    PQ_AMX_STEP(1, 6)
    PQ_AMX_STEP(2, 5)
    PQ_AMX_STEP(3, 6)
  }
  _tile_stored(0, c, kNR * 4);
  _tile_stored(1, c + 16, kNR * 4);
  if constexpr (NV > 2) {
    _tile_stored(2, c + 32, kNR * 4);
    _tile_stored(3, c + 48, kNR * 4);
  }
  PQ_MEMORY_BARRIER();
  __m512 acc[4];
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < NV; ++j) acc[j] = _mm512_load_ps(c + r * kNR + j * 16);
    store_row(o, m + r, col0, acc);
  }
}

#undef PQ_AMX_STEP

}  // namespace pagedq_gemm

#endif  // PAGEDQ_AMX
