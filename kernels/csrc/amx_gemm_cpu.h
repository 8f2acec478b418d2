// The AMX tile GEMM over gemm_cpu.h's packed bf16 weights, for row counts where the products,
// not the weight stream, bound the time (a prefill's experts: 2048 tokens x top-8 of 64 give
// each expert 256 rows, where AVX512-BF16 ran at 0.2 TFLOP/s and oneDNN's AMX at 1; the LM
// head's fp32 logits of a decode batch, 32 rows at a time: linear_cpu.cpp).
//
// The packed layout is already the tile unit's: a column block's k-pair row holds 64 columns
// of (k, k + 1) pairs, 256 bytes, so a B tile (16 k-pairs x 16 columns) is a tile load at a
// 256-byte stride, with no repacking. Rows go 32 at a time (two A tiles of 16 rows x 32 k)
// against 32 columns (two B tiles) per pass, the 2 x 2 sums in four C tiles over the whole K;
// then each row goes through the caller's epilogue (store_row, as the AVX micro-kernels call
// it).
#pragma once

#include "amx_cpu.h"
#include "gemm_cpu.h"

#if defined(PAGEDQ_AMX)

namespace pagedq_gemm {

constexpr int kAmxTileRows = 16;         // rows of an A and a C tile
constexpr int kAmxRows = 2 * kAmxTileRows;  // rows of one amx_rows call: two A tiles
constexpr int kAmxK = 32;                 // bf16 k values of an A tile row (64 bytes)

// A 2 x 2 block of tiles: C 0-3 (rows 0-15 / 16-31 x columns 0-15 / 16-31 of a pass, fp32),
// A 4-5 (the two row tiles, 32 bf16 of k), B 6-7 (the two column tiles, 16 k-pairs). Each A and
// B tile feeds two products, and the next k step's loads overlap the last products: with one A
// tile and the B tiles loaded in turns (a load waits for the product reading its tile), a
// 2,048-token expert layer ran at 0.39 TFLOP/s.
inline void amx_gemm_configure() {
  alignas(64) pagedq_amx::TileConfig c{};
  c.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = kAmxTileRows;
    c.colsb[t] = 64;
  }
  PQ_MEMORY_BARRIER();
  _tile_loadconfig(&c);
}

// True where amx_rows runs this product: AMX here and allowed, K a whole number of A tiles.
inline bool amx_gemm_usable(int64_t K) { return K % kAmxK == 0 && pagedq_amx::amx_enabled(); }

// One pass: 32 rows from `a` x the 32 columns of a packed block from `b`, over K, into c
// (32 rows x kNR floats, at column `col`).
inline void amx_pass(const uint16_t* a, int64_t ldx, const uint16_t* b, int64_t K, float* c,
                     int col) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  PQ_MEMORY_BARRIER();
  for (int64_t k = 0; k < K; k += kAmxK) {
    const uint16_t* bk = b + k / 2 * kNR * 2;
    _tile_loadd(4, a + k, ldx * 2);
    _tile_loadd(6, bk, kNR * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, bk + 32, kNR * 4);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a + kAmxTileRows * ldx + k, ldx * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c + col, kNR * 4);
  _tile_stored(1, c + col + 16, kNR * 4);
  _tile_stored(2, c + kAmxTileRows * kNR + col, kNR * 4);
  _tile_stored(3, c + kAmxTileRows * kNR + col + 16, kNR * 4);
  PQ_MEMORY_BARRIER();
}

// Rows [m, m + 32) of x (bf16, row stride ldx; rows past the caller's `rows` are read but their
// sums are dropped, so x must have 32 readable rows from m) against the NV * 16 columns of one
// packed block from `w` (K a multiple of 32). Rows m .. m + rows - 1 go to store_row(o, ...).
// The thread must have called amx_gemm_configure.
template <int NV, class O>
void amx_rows(int rows, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, const O& o,
              int64_t m, int64_t col0) {
  static_assert(NV == 2 || NV == 4, "amx_rows takes 2 or 4 column tiles");
  alignas(64) float c[kAmxRows * kNR];
  const uint16_t* a = x + m * ldx;
  amx_pass(a, ldx, w, K, c, 0);
  if constexpr (NV == 4) amx_pass(a, ldx, w + 64, K, c, 32);
  __m512 acc[4];
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < NV; ++j) acc[j] = _mm512_load_ps(c + r * kNR + j * 16);
    store_row(o, m + r, col0, acc);
  }
}

}  // namespace pagedq_gemm

#endif  // PAGEDQ_AMX

namespace pagedq_gemm {

// A thread's tile configuration for the AMX paths while it lives (`on`), released after.
struct TileScope {
  bool on;
  explicit TileScope(bool use) : on(use) {
#if defined(PAGEDQ_AMX)
    if (on) amx_gemm_configure();
#endif
  }
  ~TileScope() {
#if defined(PAGEDQ_AMX)
    if (on) _tile_release();
#endif
  }
};

}  // namespace pagedq_gemm
