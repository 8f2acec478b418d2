// In-place paged attention and KV-cache writes for the CPU, registered as torch ops pagedq::*.
//
// One call attends a whole flat varlen batch (prefill chunks and decodes mixed) of one layer. The
// work is cut into items of (request, KV head, query tile, KV chunk): a query tile holds up to
// ~32 rows, i.e. a few query tokens times the query heads of one GQA group, so every K/V row read
// from the cache (through the block table, no gathered copy) serves the whole group. Each item
// runs an online softmax in fp32 (base 2, the scale folded into q). When there are too few items
// for the threads, long key ranges are split into chunks whose partial results (unnormalised
// accumulator, running max, running sum) are merged exactly afterwards.
//
// A layer's options (kernels/attention_options.py) ride in the Layout: a sliding window moves
// each item's first key up to the window of its first row (whole blocks before it are never
// read) and masks below each row's window inside the tiles that reach under it; a soft cap maps
// scores through tanh before the mask; ALiBi adds slope x (key - query position) per query head
// after it (on the generic and decode paths: an item of ALiBi never takes the blocked-prefill or
// AMX paths); sinks join the softmax denominator when an item ends (or when split chunks merge).
// Without options each costs one predictable branch per row or tile.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

#include "amx_cpu.h"
#include "vec_cpu.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using namespace pagedq_vec;
using pagedq_vec::loadv;  // overloaded below for bf16 caches

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kMaxTileRows = 32;  // query rows (tokens x heads of one group) per work item
constexpr int kKeyTile = 64;      // keys scored at once (never crosses a cache block)

// ---- element conversions (vectorisable: bf16 is the high half of an fp32) -------------------
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  return c10::BFloat16(x);  // round to nearest even, NaN kept
}

// 2^x for x <= 0 (x = -inf gives 0), one lane of exp2_neg_v.
inline float exp2_neg(float x) { return pagedq_vec::exp2_neg_v(pagedq_vec::vfloat{} + x)[0]; }

// tanh on every lane, for soft-capped scores: -expm1(-2|x|) / (2 + expm1(-2|x|)) with the sign
// of x. Near 0, expm1 is its Taylor polynomial without the 1 (1 - e^-2|x| would cancel there);
// past ln 2 / 4 the exponential is exp2_neg_v's (1 - e keeps its bits: e < 0.85). Relative
// error about 2e-7; tanh(+-inf) = +-1.
inline pagedq_vec::vfloat tanh_v(pagedq_vec::vfloat x) {
  using pagedq_vec::vfloat;
  const vfloat a = x < 0.f ? -x : x;
  const vfloat r = a * -2.f;
  vfloat q = r * (1.f / 5040.f) + 1.f / 720.f;
  q = q * r + 1.f / 120.f;
  q = q * r + 1.f / 24.f;
  q = q * r + 1.f / 6.f;
  q = q * r + 0.5f;
  const vfloat small = r * (q * r + 1.f);  // expm1(r) for |r| <= ln 2 / 2
  const vfloat large = pagedq_vec::exp2_neg_v(r * kLog2e) - 1.f;
  const vfloat em1 = a < 0.1733f ? small : large;
  const vfloat t = -em1 / (em1 + 2.f);
  return x < 0.f ? -t : t;
}

// s[0..n) = cap * tanh(s): soft-capped scores in log2 units.
inline void soft_cap_scores(float* s, int n, float cap) {
  int j = 0;
  for (; j + pagedq_vec::kLanes <= n; j += pagedq_vec::kLanes)
    pagedq_vec::storev(s + j, tanh_v(pagedq_vec::loadv(s + j)) * cap);
  for (; j < n; ++j) s[j] = cap * tanh_v(pagedq_vec::vfloat{} + s[j])[0];
}

// ---- work items -------------------------------------------------------------------------------
struct WorkItem {
  int32_t req;
  int32_t kv_head;
  int32_t q_begin;    // first query token of the tile, relative to the request
  int32_t q_len;      // query tokens in the tile
  int32_t key_begin;  // key range [key_begin, key_end) of this item
  int32_t key_end;
  int64_t partial;    // first row of this item's partial slot, or -1: write the output directly
  int64_t cost;
};

struct SplitGroup {  // one (request, KV head, query tile) whose key range was split
  int32_t req, kv_head, q_begin, q_len;
  int64_t partial;  // first partial row of its first chunk
  int32_t num_chunks;
};

struct Layout {
  int num_heads, num_kv_heads, group, head_dim, block_size;
  int64_t q_st, q_sh, o_st, o_sh;  // token / head strides of query and out (elements)
  int64_t bt_sr, bt_sb;            // block_table strides
  int64_t cache_block, cache_slot, cache_head;  // element strides of a block, slot, head in K/V
  int block_shift;  // log2(block_size) when it is a power of two, else -1
  // The layer's options. window: query position p sees keys p - window < k <= p (0: all k <=
  // p). cap: scores s (q scaled by scale / soft cap) become cap * tanh(s), cap = soft cap x
  // log2 e (0: no cap). sinks: one logit per query head in log2 units, or null. alibi: one
  // slope per query head in log2 units, or null: row i's score of key k gains
  // alibi[head] * (k - pos_i), which is 0 on the diagonal and negative below it.
  int window;
  float cap;
  const float* sinks;
  const float* alibi;
};

// Adds row i's ALiBi bias to its scores s[0..n) of keys key0..key0+n-1 (query position pos).
inline void alibi_scores(float* s, int n, float slope, int64_t key0, int64_t pos) {
  const float base = static_cast<float>(key0 - pos);
#pragma omp simd
  for (int j = 0; j < n; ++j) s[j] += slope * (base + static_cast<float>(j));
}

// The first key query position pos sees (0 without a window).
inline int64_t window_start(const Layout& L, int64_t pos) {
  return L.window > 0 ? std::max<int64_t>(0, pos - L.window + 1) : 0;
}

// The block of a key and its slot in the block: a shift and a mask for the usual power-of-two
// block sizes. As divisions, a decode tile issued three or more of them (its own block and the
// two prefetch targets'), part of what a 0.9x change on cache-resident decodes took out.
inline int block_index(const Layout& L, int key) {
  return L.block_shift >= 0 ? key >> L.block_shift : key / L.block_size;
}
inline int block_offset(const Layout& L, int key) {
  return L.block_shift >= 0 ? key & (L.block_size - 1) : key % L.block_size;
}

template <int D>
struct Dim {
  static constexpr int get(int) { return D; }
};
template <>
struct Dim<0> {
  static int get(int d) { return d; }
};

// Loads a work item's query rows into q_f (fp32, scaled by qk_scale) and clears its online-softmax
// state. Row i is query token q_begin + i / G of the request and query head kv_head * G + i % G.
template <typename scalar_t>
void begin_item(const WorkItem& w, const Layout& L, int D, const scalar_t* query, int64_t q_start,
                float qk_scale, float* q_f, float* acc, float* m, float* l) {
  const int G = L.group;
  for (int i = 0; i < w.q_len * G; ++i) {
    const scalar_t* src =
        query + (q_start + w.q_begin + i / G) * L.q_st + (w.kv_head * G + i % G) * L.q_sh;
    float* q = q_f + i * D;
    float* a = acc + i * D;
#pragma omp simd
    for (int d = 0; d < D; ++d) {
      q[d] = to_float(src[d]) * qk_scale;
      a[d] = 0.f;
    }
    m[i] = kNegInf;
    l[i] = 0.f;
  }
}

// The factor on a row's accumulator (sum of 2^(s - m) V) that gives its output when a sink of
// logit `sink` joins the denominator: 2^(m - M) / (l 2^(m - M) + 2^(sink - M)), M = max(m, sink)
// so that neither power overflows.
inline float sink_factor(float sink, float m, float l) {
  const float top = std::max(m, sink);
  const float keep = exp2_neg(m - top);  // 0 when the row saw no key (m = -inf)
  return keep / (l * keep + exp2_neg(sink - top));
}

// Ends a work item: a KV chunk of a split keeps its unnormalised accumulator, max and sum for the
// merge; a whole item writes acc / l to its output rows.
template <typename scalar_t>
void finish_item(const WorkItem& w, const Layout& L, int D, int64_t q_start, const float* acc,
                 const float* m, const float* l, scalar_t* out, float* partial_acc,
                 float* partial_ml) {
  const int G = L.group;
  const int rows = w.q_len * G;
  if (w.partial >= 0) {
    for (int i = 0; i < rows; ++i) {
      std::memcpy(partial_acc + (w.partial + i) * D, acc + i * D, D * sizeof(float));
      partial_ml[2 * (w.partial + i)] = m[i];
      partial_ml[2 * (w.partial + i) + 1] = l[i];
    }
    return;
  }
  for (int i = 0; i < rows; ++i) {
    scalar_t* dst =
        out + (q_start + w.q_begin + i / G) * L.o_st + (w.kv_head * G + i % G) * L.o_sh;
    const float inv = L.sinks == nullptr ? (l[i] > 0.f ? 1.f / l[i] : 0.f)
                                         : sink_factor(L.sinks[w.kv_head * G + i % G], m[i], l[i]);
    const float* a = acc + i * D;
#pragma omp simd
    for (int d = 0; d < D; ++d) dst[d] = from_float<scalar_t>(a[d] * inv);
  }
}

// Online-softmax attention of one work item. q_scaled/acc/score are per-thread scratch.
template <typename scalar_t, typename cache_t, int DT>
void attend_item(const WorkItem& w, const Layout& L, const scalar_t* query, const cache_t* k_cache,
                 const cache_t* v_cache, const int64_t* block_table, const int64_t* qsl,
                 const int64_t* seq_lens, float qk_scale, scalar_t* out, float* partial_acc,
                 float* partial_ml, float* q_f, float* acc, float* score, float* m, float* l,
                 float* kv_row) {
  const int D = Dim<DT>::get(L.head_dim);
  const int G = L.group;
  const int rows = w.q_len * G;
  const int64_t q_start = qsl[w.req];
  const int64_t query_len = qsl[w.req + 1] - q_start;
  const int64_t context_len = seq_lens[w.req] - query_len;

  begin_item(w, L, D, query, q_start, qk_scale, q_f, acc, m, l);
  // Query row i sits at absolute position context_len + q_begin + i / G.
  const int64_t first_pos = context_len + w.q_begin;
  const int64_t* bt_row = block_table + w.req * L.bt_sr;
  const int64_t head_off = static_cast<int64_t>(w.kv_head) * L.cache_head;

  int key = w.key_begin;
  while (key < w.key_end) {
    const int in_block = block_offset(L, key);
    const int n = std::min({w.key_end - key, L.block_size - in_block, kKeyTile});
    const int64_t block = bt_row[block_index(L, key) * L.bt_sb];
    const int64_t base = block * L.cache_block + in_block * L.cache_slot + head_off;
    const cache_t* kp = k_cache + base;
    const cache_t* vp = v_cache + base;

    // scores[i][j] = q_i . k_j (already in log2 units)
    for (int j = 0; j < n; ++j) {
      const cache_t* kr = kp + j * L.cache_slot;
      const float* kf;
      if constexpr (std::is_same_v<cache_t, float>) {
        kf = kr;
      } else {
#pragma omp simd
        for (int d = 0; d < D; ++d) kv_row[d] = to_float(kr[d]);
        kf = kv_row;
      }
      for (int i = 0; i < rows; ++i) {
        const float* qi = q_f + i * D;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int d = 0; d < D; ++d) s += qi[d] * kf[d];
        score[i * kKeyTile + j] = s;
      }
    }
    if (L.cap > 0.f)
      for (int i = 0; i < rows; ++i) soft_cap_scores(score + i * kKeyTile, n, L.cap);
    if (L.alibi != nullptr)
      for (int i = 0; i < rows; ++i)
        alibi_scores(score + i * kKeyTile, n, L.alibi[w.kv_head * G + i % G], key,
                     first_pos + i / G);
    // causal mask: only tiles that reach past the tile's first query position need it
    if (key + n - 1 > first_pos) {
      for (int i = 0; i < rows; ++i) {
        const int64_t pos = first_pos + i / G;
        for (int j = 0; j < n; ++j)
          if (key + j > pos) score[i * kKeyTile + j] = kNegInf;
      }
    }
    // window: only tiles that start below the last row's window
    if (key < window_start(L, first_pos + w.q_len - 1)) {
      for (int i = 0; i < rows; ++i) {
        const int64_t lo = window_start(L, first_pos + i / G);
        for (int j = 0; j < n; ++j)
          if (key + j < lo) score[i * kKeyTile + j] = kNegInf;
      }
    }
    // online softmax update
    for (int i = 0; i < rows; ++i) {
      float* s = score + i * kKeyTile;
      float mx = kNegInf;
      for (int j = 0; j < n; ++j) mx = std::max(mx, s[j]);
      const float m_new = std::max(m[i], mx);
      if (m_new == kNegInf) {  // nothing visible yet: p = 0 everywhere
#pragma omp simd
        for (int j = 0; j < n; ++j) s[j] = 0.f;
        continue;
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < n; ++j) {
        const float p = exp2_neg(s[j] - m_new);
        s[j] = p;
        sum += p;
      }
      if (m_new != m[i]) {
        const float alpha = exp2_neg(m[i] - m_new);
        float* a = acc + i * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) a[d] *= alpha;
        l[i] *= alpha;
        m[i] = m_new;
      }
      l[i] += sum;
    }
    // acc += p @ V
    for (int j = 0; j < n; ++j) {
      const cache_t* vr = vp + j * L.cache_slot;
      const float* vf;
      if constexpr (std::is_same_v<cache_t, float>) {
        vf = vr;
      } else {
#pragma omp simd
        for (int d = 0; d < D; ++d) kv_row[d] = to_float(vr[d]);
        vf = kv_row;
      }
      for (int i = 0; i < rows; ++i) {
        const float p = score[i * kKeyTile + j];
        float* a = acc + i * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) a[d] += p * vf[d];
      }
    }
    key += n;
  }

  finish_item(w, L, D, q_start, acc, m, l, out, partial_acc, partial_ml);
}

// ---- the vector path (head_dim a multiple of the vector width) ------------------------------
// GCC/Clang vector extensions of the target's native width: 16 floats with AVX-512, 8 with AVX2
// (vectors wider than the registers spill: on an AVX2 host the 16-wide version ran 3-6x slower).
// Keys come in tiles of 16 (never crossing a cache block). Decode items (few rows, decode_item):
// each row accumulates one vector per key, a transpose-reduce turns kLanes of them into kLanes
// dot products without horizontal sums, and the softmax runs once over the item's scores.
// Prefill tiles (attend_item_vec): K^T of the tile once, then several rows at a time with
// broadcast FMAs, so that every K^T and V vector loaded serves all of them.
#if defined(__AVX512F__)
constexpr int kRowBlock = 6;  // prefill rows scored together (6 x 1 score accumulators)
constexpr int kPvRows = 6;    // prefill rows of one p @ V pass ...
constexpr int kPvVecs = 4;    // ... times output vectors: accumulators in registers
#else
constexpr int kRowBlock = 6;  // 6 x 2 score accumulators
constexpr int kPvRows = 3;    // 3 x 4 (6 x 2 spilled on GCC 12: it hoists all 6 broadcasts)
constexpr int kPvVecs = 4;
#endif
constexpr int kTile = 16;                  // keys per tile
constexpr int kTileVecs = kTile / kLanes;  // vectors of one row of a tile's scores
// Prefetching. One tile ahead into L1 (prefetcht0) made a decode over 30 DRAM-cold layer caches
// 14-16% faster on a 2-core Xeon VM (AVX-512, no AMX), where prefetching 2-16 tiles ahead into L2
// did nothing; on an earlier AVX-512 VM, 8 tiles ahead into L2 took a 64 x 512 decode from 7.8
// to 5.8 ms per layer and L1 did nothing; on a 2-core Xeon with AMX and a head-major cache, the
// L2 prefetch took the two-pass decode from 2.86 to 2.69 ms per layer. Both run.
constexpr int kFarPrefetchTiles = 8;

// The rows of one tile in a cache: where the first starts, how many, and the bytes between two.
struct TileRows {
  const char* first;  // null: no tile there
  int rows;
  int64_t stride;
  int row_bytes;
};

// The tile of item w's head that starts at `key` in `cache` (K or V); {null} past its keys.
template <typename cache_t>
__attribute__((always_inline)) inline TileRows tile_rows(const WorkItem& w, const Layout& L,
                                                         int D, const int64_t* block_table,
                                                         const cache_t* cache, int key) {
  if (key >= w.key_end) return {nullptr, 0, 0, 0};
  const int64_t block = block_table[w.req * L.bt_sr + block_index(L, key) * L.bt_sb];
  const int in_block = block_offset(L, key);
  const cache_t* first = cache + block * L.cache_block + in_block * L.cache_slot +
                         static_cast<int64_t>(w.kv_head) * L.cache_head;
  return {reinterpret_cast<const char*>(first),
          std::min({w.key_end - key, L.block_size - in_block, kTile}),
          L.cache_slot * static_cast<int64_t>(sizeof(cache_t)),
          D * static_cast<int>(sizeof(cache_t))};
}

// Prefetches rows [begin, end) of a tile with the given locality hint (3: L1, 1: L2).
// Always inlined: as a call it cost more than it saved (the caller's vectors spill around it).
template <int Locality>
__attribute__((always_inline)) inline void prefetch_rows(const TileRows& t, int begin, int end) {
  if (t.first == nullptr) return;
  for (int r = begin; r < end; ++r)
    for (int c = 0; c < t.row_bytes; c += 64)
      __builtin_prefetch(t.first + r * t.stride + c, 0, Locality);
}

// A decode item's reads in the order it makes them: its K tiles, then its V tiles, then (for
// prefetching only) the next item's K tiles. Positions are keys from the item's key_begin, each
// half rounded up to whole tiles. Prefetching along this order keeps misses in flight across
// the switch from K to V and from one item to the next; prefetching each pass on its own left
// the first tiles of every pass cold, a quarter of a 512-key item's tiles.
struct DecodeStream {
  const WorkItem* item;
  const WorkItem* next;  // the item this thread takes next, or null
  int half;              // keys of one half (K or V), rounded up to a multiple of `unit`
  int unit;              // every tile starts at a multiple of this many keys from key_begin
};

inline DecodeStream decode_stream(const WorkItem& w, const WorkItem* next, const Layout& L) {
  const int unit = std::gcd(L.block_size, kTile);
  const int keys = w.key_end - w.key_begin;
  return {&w, next, (keys + unit - 1) / unit * unit, unit};
}

// The tile at stream position pos (a multiple of st.unit), or {null} past the stream's end.
template <typename cache_t>
__attribute__((always_inline)) inline TileRows stream_tile(const DecodeStream& st,
                                                           const Layout& L, int D,
                                                           const int64_t* block_table,
                                                           const cache_t* k_cache,
                                                           const cache_t* v_cache, int pos) {
  if (pos < st.half) return tile_rows(*st.item, L, D, block_table, k_cache, st.item->key_begin + pos);
  pos -= st.half;
  if (pos < st.half) return tile_rows(*st.item, L, D, block_table, v_cache, st.item->key_begin + pos);
  pos -= st.half;
  if (st.next == nullptr) return {nullptr, 0, 0, 0};
  return tile_rows(*st.next, L, D, block_table, k_cache, st.next->key_begin + pos);
}

// A decode tile of n keys at stream position pos starts by prefetching the next tile into L1,
// and hands back the tile kFarPrefetchTiles ahead, whose rows its compute prefetches into L2 a
// few at a time: issued in one burst before the compute, the same prefetches queued ahead of the
// tile's own loads, and a decode took 1.3x the time (2-core EPYC, docs/PERFORMANCE.md).
template <typename cache_t>
__attribute__((always_inline)) inline TileRows prefetch_ahead(const DecodeStream& st,
                                                              const Layout& L, int D,
                                                              const int64_t* block_table,
                                                              const cache_t* k_cache,
                                                              const cache_t* v_cache, int pos,
                                                              int n) {
  const int after = (pos + n + st.unit - 1) / st.unit * st.unit;
  const TileRows next = stream_tile(st, L, D, block_table, k_cache, v_cache, after);
  prefetch_rows<3>(next, 0, next.rows);
  return stream_tile(st, L, D, block_table, k_cache, v_cache,
                     after + (kFarPrefetchTiles - 1) * kTile);
}

// Tiles with fewer rows (decodes) go to decode_item; larger ones transpose K once per tile.
constexpr int kBlockedMinRows = 12;

inline vfloat loadv(const c10::BFloat16* p) {
  return widen_bf16(reinterpret_cast<const uint16_t*>(p));
}

// The largest divisor of c that is at most cap: vectors per pass when c do not fit at once.
constexpr int pass_vecs(int c, int cap) {
  for (int b = cap < c ? cap : c; b > 1; --b)
    if (c % b == 0) return b;
  return 1;
}


inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }

// r[j] = sum of the lanes of v[j], for kLanes vectors: each round halves the lanes per vector
// and the number of vectors.
#define PQ_SH(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
inline vfloat transpose_reduce(vfloat* v) {
#if defined(__AVX512F__)
  vfloat a[8], b[4], c[2];
  for (int k = 0; k < 8; ++k)
    a[k] = PQ_SH(v[2 * k], v[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           PQ_SH(v[2 * k], v[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                 30, 31);
  for (int k = 0; k < 4; ++k)
    b[k] = PQ_SH(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                 27) +
           PQ_SH(a[2 * k], a[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                 31);
  for (int k = 0; k < 2; ++k)
    c[k] = PQ_SH(b[2 * k], b[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28,
                 29) +
           PQ_SH(b[2 * k], b[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                 31);
  return PQ_SH(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         PQ_SH(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  vfloat a[4], b[2];
  for (int k = 0; k < 4; ++k)
    a[k] = PQ_SH(v[2 * k], v[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           PQ_SH(v[2 * k], v[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int k = 0; k < 2; ++k)
    b[k] = PQ_SH(a[2 * k], a[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           PQ_SH(a[2 * k], a[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return PQ_SH(b[0], b[1], 0, 2, 4, 6, 8, 10, 12, 14) + PQ_SH(b[0], b[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

// The largest lane of v, by halving the vector: log2(kLanes) dependent steps, not kLanes.
inline float max_lanes(vfloat v) {
#if defined(__AVX512F__)
  v = vmax(v, PQ_SH(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, PQ_SH(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, PQ_SH(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = vmax(v, PQ_SH(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
#else
  v = vmax(v, PQ_SH(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = vmax(v, PQ_SH(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
  v = vmax(v, PQ_SH(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
#endif
  return v[0];
}

// Transposes kLanes x kLanes floats held as kLanes row vectors, in place: at each step b, the
// rows i and i + b (i & b == 0) trade their off-diagonal b x b blocks (a block transpose,
// halving b). With shuffles instead of kLanes^2 scalar moves, K^T of a prefill tile cost a
// quarter of what it did (it was a tenth of the tile's time).
inline void transpose_lanes(vfloat* r) {
#define PQ_SWAP(b, ...)                                                \
  for (int i = 0; i < kLanes; ++i)                                    \
    if ((i & (b)) == 0) {                                             \
      const vfloat lo = PQ_SH(r[i], r[i + (b)], __VA_ARGS__);         \
      r[i + (b)] = PQ_SH(r[i], r[i + (b)], PQ_HI_##b);                \
      r[i] = lo;                                                      \
    }
#if defined(__AVX512F__)
#define PQ_HI_8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define PQ_HI_4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define PQ_HI_2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define PQ_HI_1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
  PQ_SWAP(8, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
  PQ_SWAP(4, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
  PQ_SWAP(2, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
  PQ_SWAP(1, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
#undef PQ_HI_8
#else
#define PQ_HI_4 4, 5, 6, 7, 12, 13, 14, 15
#define PQ_HI_2 2, 3, 10, 11, 6, 7, 14, 15
#define PQ_HI_1 1, 9, 3, 11, 5, 13, 7, 15
  PQ_SWAP(4, 0, 1, 2, 3, 8, 9, 10, 11)
  PQ_SWAP(2, 0, 1, 8, 9, 4, 5, 12, 13)
  PQ_SWAP(1, 0, 8, 2, 10, 4, 12, 6, 14)
#endif
#undef PQ_HI_4
#undef PQ_HI_2
#undef PQ_HI_1
#undef PQ_SWAP
}
#undef PQ_SH

// Online-softmax update of R rows with one tile's scores s[r] (in registers), of which the
// first limit[r] are visible: p[r] = 2^(s - new max), 0 past limit; alpha[r] is the factor on
// the row's old sums. Row sums stay lane-wise in l_lanes (summed once, when the item ends) and a
// tile's max is a shuffle tree: with a scalar chain for each, and one row at a time, the softmax
// took a third of a prefill tile's time. The rows' exp chains are independent, so written side
// by side they overlap. kLower (tiles under a sliding window): keys before start[r] are not
// visible either.
template <int R, bool kLower>
__attribute__((always_inline)) inline void softmax_rows(const vfloat (&s)[R][kTileVecs],
                                                        const int* start, const int* limit,
                                                        float* m, float* l_lanes,
                                                        float (*p)[kTile], float* alpha) {
  vint lane;
  for (int j = 0; j < kLanes; ++j) lane[j] = j;
  vfloat v[R][kTileVecs];
  float m_new[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    vfloat mx = vfloat{} + kNegInf;
#pragma GCC unroll 4
    for (int k = 0; k < kTileVecs; ++k) {
      vint visible = lane + k * kLanes < limit[r];
      if constexpr (kLower) visible &= lane + k * kLanes >= start[r];
      v[r][k] = visible ? s[r][k] : vfloat{} + kNegInf;
      mx = vmax(mx, v[r][k]);
    }
    // A row that sees nothing here keeps its max and sums: p = 2^(-inf - 0) = 0, alpha = 1.
    const bool any = limit[r] > (kLower ? start[r] : 0);
    m_new[r] = any ? std::max(m[r], max_lanes(mx)) : 0.f;
    alpha[r] = any ? exp2_neg(m[r] - m_new[r]) : 1.f;
    if (any) m[r] = m_new[r];
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    vfloat sum = {};
#pragma GCC unroll 4
    for (int k = 0; k < kTileVecs; ++k) {
      const vfloat e = exp2_neg_v(v[r][k] - m_new[r]);
      storev(p[r] + k * kLanes, e);
      sum += e;
    }
    storev(l_lanes + r * kLanes, loadv(l_lanes + r * kLanes) * alpha[r] + sum);
  }
}

// acc[r] = acc[r] * alpha[r] + sum_j p[r][j] V[j] for `nrows` rows (R at most), in passes of CB
// output vectors so that R x CB accumulators stay in registers.
template <int D, int R, int CB, typename v_t>
inline void accumulate_pv(float* acc, const float* p, int p_stride, const float* alpha,
                          const v_t* vf, int64_t kv_stride, int keys) {
  constexpr int C = D / kLanes;
  for (int c0 = 0; c0 < C; c0 += CB) {
    vfloat a[R][CB];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int c = 0; c < CB; ++c) a[r][c] = loadv(acc + r * D + (c0 + c) * kLanes) * alpha[r];
    for (int j = 0; j < keys; ++j) {
      const v_t* vr = vf + j * kv_stride + c0 * kLanes;
#pragma GCC unroll 16
      for (int c = 0; c < CB; ++c) {
        const vfloat v = loadv(vr + c * kLanes);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) a[r][c] += p[r * p_stride + j] * v;
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int c = 0; c < CB; ++c) storev(acc + r * D + (c0 + c) * kLanes, a[r][c]);
  }
}

// ---- bf16 caches in decodes ------------------------------------------------------------------
// acc[r] += sum_j p[r][j] V[j] for R rows over a bf16 V, the accumulators in [evens, odds]
// order per 2 * kLanes chunk (P chunks per pass, so that R x 2P accumulators stay in registers).
template <int D, int R, int P>
inline void accumulate_pv_pairs(float* acc, const float* p, int p_stride,
                                const c10::BFloat16* vf, int64_t kv_stride, int keys) {
  constexpr int C2 = D / (2 * kLanes);
  for (int c0 = 0; c0 < C2; c0 += P) {
    vfloat a[R][2 * P];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int c = 0; c < 2 * P; ++c) a[r][c] = loadv(acc + r * D + (2 * c0 + c) * kLanes);
    for (int j = 0; j < keys; ++j) {
      const c10::BFloat16* vr = vf + j * kv_stride + c0 * 2 * kLanes;
#pragma GCC unroll 16
      for (int c = 0; c < P; ++c) {
        vfloat even, odd;
        widen_bf16_pairs(reinterpret_cast<const uint16_t*>(vr + c * 2 * kLanes), even, odd);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const float pr = p[r * p_stride + j];
          a[r][2 * c] += pr * even;
          a[r][2 * c + 1] += pr * odd;
        }
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int c = 0; c < 2 * P; ++c) storev(acc + r * D + (2 * c0 + c) * kLanes, a[r][c]);
  }
}

#if defined(__AVX512BF16__)
// The scores of a bf16 tile with AVX512-BF16 dot products, K read as it lies in the cache (no
// widening): q = hi + lo in bf16 (16 bits of q's 24), each product exact in fp32, so the scores
// match fp32 arithmetic on the widened K to about 2^-16 of q.
template <int D, typename RowOf>
__attribute__((always_inline)) inline void score_tile_dp(const uint16_t* q_hi,
                                                         const uint16_t* q_lo, int rows,
                                                         float* s, int stride, int n,
                                                         RowOf row_of, const TileRows& far,
                                                         int far_per_row) {
  constexpr int C2 = D / 32;
  for (int i = 0; i < rows; ++i) {
    for (int j0 = 0; j0 < n; j0 += kLanes) {
      __m512 dots[kLanes];
#pragma GCC unroll 16
      for (int j = 0; j < kLanes; ++j) dots[j] = _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int c = 0; c < C2; ++c) {
        const __m512bh qh = (__m512bh)_mm512_loadu_si512(q_hi + i * D + c * 32);
        const __m512bh ql = (__m512bh)_mm512_loadu_si512(q_lo + i * D + c * 32);
#pragma GCC unroll 16
        for (int j = 0; j < kLanes; ++j) {
          const __m512bh k = (__m512bh)_mm512_loadu_si512(row_of(j0 + j) + c * 32);
          dots[j] = _mm512_dpbf16_ps(dots[j], qh, k);
          dots[j] = _mm512_dpbf16_ps(dots[j], ql, k);
        }
      }
      vfloat v[kLanes];
#pragma GCC unroll 16
      for (int j = 0; j < kLanes; ++j) v[j] = (vfloat)dots[j];
      storev(s + i * stride + j0, transpose_reduce(v));
    }
    prefetch_rows<1>(far, std::min(i * far_per_row, far.rows),
                     std::min((i + 1) * far_per_row, far.rows));
  }
}
#endif

// Scores of one decode tile: s[i * stride + j] = q_i . K_j for `rows` query rows and keys j <
// n (rounded up to whole vectors), K row j at row_of(j); then row i's share of the far prefetch.
template <int D, typename RowOf>
__attribute__((always_inline)) inline void score_tile(const float* q_f, int rows, float* s,
                                                      int stride, int n, RowOf row_of,
                                                      const TileRows& far, int far_per_row) {
  constexpr int C = D / kLanes;
  for (int i = 0; i < rows; ++i) {
    const float* qi = q_f + i * D;
    for (int j0 = 0; j0 < n; j0 += kLanes) {
      vfloat dots[kLanes] = {};
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) {
        const vfloat qc = loadv(qi + c * kLanes);
#pragma GCC unroll 16
        for (int j = 0; j < kLanes; ++j) dots[j] += qc * loadv(row_of(j0 + j) + c * kLanes);
      }
      storev(s + i * stride + j0, transpose_reduce(dots));
    }
    prefetch_rows<1>(far, std::min(i * far_per_row, far.rows),
                     std::min((i + 1) * far_per_row, far.rows));
  }
}

// A decode item's softmax, one per row of S (stride apart) over its visible keys, in place:
// p = 0 outside them (and in the padding rows past `rows`); m and l get each row's max and sum.
// Row i sees keys [lo, visible) of the item: below lo lies outside its sliding window.
inline void decode_softmax(float* S, int stride, int rows, int padded_rows, const Layout& L,
                           int64_t first_pos, int key_begin, int num_keys, int kv_head, float* m,
                           float* l) {
  for (int i = 0; i < padded_rows; ++i) {
    float* si = S + i * stride;
    const int64_t pos = first_pos + i / L.group;
    const int64_t limit = i < rows ? pos + 1 - key_begin : 0;
    const int visible = static_cast<int>(std::clamp<int64_t>(limit, 0, num_keys));
    const int lo = static_cast<int>(
        std::clamp<int64_t>(window_start(L, pos) - key_begin, 0, visible));
    if (visible == lo) {
      std::fill(si, si + num_keys, 0.f);
      continue;  // m stays -inf and l 0: this row sees nothing of this item
    }
    std::fill(si, si + lo, 0.f);
    if (L.cap > 0.f) soft_cap_scores(si + lo, visible - lo, L.cap);
    if (L.alibi != nullptr)
      alibi_scores(si + lo, visible - lo, L.alibi[kv_head * L.group + i % L.group],
                   key_begin + lo, pos);
    vfloat vm = vfloat{} + kNegInf;
    int j = lo;
    for (; j + kLanes <= visible; j += kLanes) vm = vmax(vm, loadv(si + j));
    float mx = max_lanes(vm);
    for (; j < visible; ++j) mx = std::max(mx, si[j]);
    vfloat vsum = {};
    j = lo;
    for (; j + kLanes <= visible; j += kLanes) {
      const vfloat p = exp2_neg_v(loadv(si + j) - mx);
      storev(si + j, p);
      vsum += p;
    }
    float sum = sum_lanes(vsum);
    for (; j < visible; ++j) {
      si[j] = exp2_neg(si[j] - mx);
      sum += si[j];
    }
    std::fill(si + visible, si + num_keys, 0.f);
    m[i] = mx;
    l[i] = sum;
  }
}

// Rows of a decode's p @ V pass: the query heads of a GQA group (3 for SmolLM2) share each V row.
constexpr int kDecodePvRows = 3;

// A decode item (fewer than kBlockedMinRows rows) in two passes over its keys: every score
// first (K read in place, a bf16 cache widened in registers), one exact softmax per row, then
// p @ V. Against an online softmax per tile this drops the per-tile max, rescale and
// accumulator reload, and each pass streams one array (K, then V). `scores` grows as needed.
template <typename scalar_t, typename cache_t, int D>
void decode_item(const WorkItem& w, const Layout& L, const scalar_t* query,
                 const cache_t* k_cache, const cache_t* v_cache, const int64_t* block_table,
                 const int64_t* qsl, const int64_t* seq_lens, float qk_scale, scalar_t* out,
                 float* partial_acc, float* partial_ml, float* q_f, float* acc, float* m,
                 float* l, std::vector<float>& scores, float* k_tile, const WorkItem* next) {
  constexpr int C = D / kLanes;
  const int G = L.group;
  const int rows = w.q_len * G;
  const int64_t q_start = qsl[w.req];
  const int64_t context_len = seq_lens[w.req] - (qsl[w.req + 1] - q_start);
  begin_item(w, L, D, query, q_start, qk_scale, q_f, acc, m, l);
  // bf16 caches whose head_dim is whole pairs of vectors: V widened in [evens, odds] pairs
  // (widen_bf16_pairs), and K too (q split the same way) or, with AVX512-BF16, K scored as it
  // lies against q split into bf16 hi + lo (kept in k_tile's room). A 64 x 512 decode over
  // DRAM-cold bf16 caches took 0.82-0.85x the time with both (V pairs alone: 0.91-0.92x) on a
  // Zen 4 EPYC, and 0.87x built for AVX2 (docs/PERFORMANCE.md).
  constexpr bool kPairs = !std::is_same_v<cache_t, float> && D % (2 * kLanes) == 0;
#if defined(__AVX512BF16__)
  constexpr bool kDotBf16 = true;
#else
  constexpr bool kDotBf16 = false;
#endif
  uint16_t* q_hi = reinterpret_cast<uint16_t*>(k_tile);
  uint16_t* q_lo = q_hi + rows * D;
  if constexpr (kPairs && kDotBf16) {
    for (int e = 0; e < rows * D; ++e) {
      const c10::BFloat16 hi(q_f[e]);
      const c10::BFloat16 lo(q_f[e] - static_cast<float>(hi));
      q_hi[e] = hi.x;
      q_lo[e] = lo.x;
    }
  } else if constexpr (kPairs) {
    eo_split(q_f, rows, D);  // K's tiles are widened in that order too
  }
  const int64_t first_pos = context_len + w.q_begin;
  const int64_t* bt_row = block_table + w.req * L.bt_sr;
  const int64_t head_off = static_cast<int64_t>(w.kv_head) * L.cache_head;
  const int num_keys = w.key_end - w.key_begin;
  const DecodeStream st = decode_stream(w, next, L);
  // A row of scores has room for a whole last tile; rows are padded to a multiple of the p @ V
  // pass with zeros, so that the pass reads (and ignores) them safely.
  const int stride = (num_keys + kTile + kLanes - 1) / kLanes * kLanes;
  const int padded_rows = (rows + kDecodePvRows - 1) / kDecodePvRows * kDecodePvRows;
  if (scores.size() < static_cast<size_t>(padded_rows) * stride)
    scores.resize(static_cast<size_t>(padded_rows) * stride);
  float* S = scores.data();
  // The far prefetch of a tile is spread over its compute: this many rows per query row (pass
  // 1) or per p @ V pass (pass 2), fixed per item so that no tile divides.
  const int passes = (rows + kDecodePvRows - 1) / kDecodePvRows;
  const int far_per_row = (kTile + rows - 1) / rows;
  const int far_per_pass = (kTile + passes - 1) / passes;

  // Pass 1: S[i][k - key_begin] = q_i . k (log2 units).
  for (int key = w.key_begin; key < w.key_end;) {
    const int in_block = block_offset(L, key);
    const int n = std::min({w.key_end - key, L.block_size - in_block, kTile});
    const int64_t block = bt_row[block_index(L, key) * L.bt_sb];
    const cache_t* kp = k_cache + block * L.cache_block + in_block * L.cache_slot + head_off;
    const TileRows far = prefetch_ahead(st, L, D, block_table, k_cache, v_cache, key - w.key_begin, n);
    float* s = S + (key - w.key_begin);
    if constexpr (kPairs && kDotBf16) {
#if defined(__AVX512BF16__)  // a discarded branch still needs the name declared (AVX2 builds)
      const uint16_t* kb = reinterpret_cast<const uint16_t*>(kp);
      const int64_t slot = L.cache_slot;
      score_tile_dp<D>(q_hi, q_lo, rows, s, stride, n,
                       [kb, slot, n](int j) { return kb + std::min(j, n - 1) * slot; }, far,
                       far_per_row);
#endif
    } else if constexpr (!std::is_same_v<cache_t, float>) {
      // bf16: widen the tile's rows once into k_tile (rows past n repeat the last one), not
      // once per query row: 0.92-0.95x the time of a decode, cold or cache-resident.
      if constexpr (kPairs) {
        for (int j = 0; j < kTile; ++j)
#pragma GCC unroll 16
          for (int c = 0; c < C; c += 2) {
            vfloat even, odd;
            widen_bf16_pairs(
                reinterpret_cast<const uint16_t*>(kp + std::min(j, n - 1) * L.cache_slot) +
                    c * kLanes,
                even, odd);
            storev(k_tile + j * D + c * kLanes, even);
            storev(k_tile + j * D + (c + 1) * kLanes, odd);
          }
      } else {
        for (int j = 0; j < kTile; ++j)
#pragma GCC unroll 16
          for (int c = 0; c < C; ++c)
            storev(k_tile + j * D + c * kLanes,
                   loadv(kp + std::min(j, n - 1) * L.cache_slot + c * kLanes));
      }
      const float* kt = k_tile;
      score_tile<D>(q_f, rows, s, stride, n, [kt](int j) { return kt + j * D; }, far,
                    far_per_row);
    } else if (n == kTile && L.cache_slot == D) {
      // A whole tile of a head-major cache: its rows sit D apart, constant offsets from kp.
      score_tile<D>(q_f, rows, s, stride, kTile, [kp](int j) { return kp + j * D; }, far,
                    far_per_row);
    } else {
      // Lanes past the tile read its last key again; the next tile overwrites their scores.
      const cache_t* krow[kTile];
      for (int j = 0; j < kTile; ++j) krow[j] = kp + std::min(j, n - 1) * L.cache_slot;
      score_tile<D>(q_f, rows, s, stride, n, [&krow](int j) { return krow[j]; }, far, far_per_row);
    }
    key += n;
  }

  // One softmax per row over its visible keys; p = 0 past them (and in the padding rows).
  decode_softmax(S, stride, rows, padded_rows, L, first_pos, w.key_begin, num_keys, w.kv_head, m,
                 l);

  // Pass 2: acc[i] = sum_k p[i][k] V[k], the rows of a pass sharing every V row loaded.
  constexpr float kOnes[kDecodePvRows] = {1.f, 1.f, 1.f};
  static_assert(kDecodePvRows == 3, "kOnes holds one factor per row of a pass");
  for (int key = w.key_begin; key < w.key_end;) {
    const int in_block = block_offset(L, key);
    const int n = std::min({w.key_end - key, L.block_size - in_block, kTile});
    const int64_t block = bt_row[block_index(L, key) * L.bt_sb];
    const cache_t* vp = v_cache + block * L.cache_block + in_block * L.cache_slot + head_off;
    const TileRows far =
        prefetch_ahead(st, L, D, block_table, k_cache, v_cache, st.half + key - w.key_begin, n);
    for (int pass = 0; pass < passes; ++pass) {
      const int r0 = pass * kDecodePvRows;
      if constexpr (kPairs)
        accumulate_pv_pairs<D, kDecodePvRows, pass_vecs(C / 2, kPvVecs / 2)>(
            acc + r0 * D, S + r0 * stride + (key - w.key_begin), stride, vp, L.cache_slot, n);
      else
        accumulate_pv<D, kDecodePvRows, pass_vecs(C, kPvVecs)>(
            acc + r0 * D, S + r0 * stride + (key - w.key_begin), stride, kOnes, vp,
            L.cache_slot, n);
      prefetch_rows<1>(far, std::min(pass * far_per_pass, far.rows),
                       std::min((pass + 1) * far_per_pass, far.rows));
    }
    key += n;
  }
  if constexpr (kPairs) eo_interleave(acc, rows, D);
  finish_item(w, L, D, q_start, acc, m, l, out, partial_acc, partial_ml);
}

// ---- AMX decodes (bf16 caches) ----------------------------------------------------------------
// With AMX (Sapphire Rapids and later) a decode item's two products run on the tile unit, the
// two-pass structure of decode_item kept, and K and V both go to the tiles as they lie in the
// cache (tile loads at the cache's row stride, no widening, no copy). What it gains is mostly
// the AVX path's widening and FMAs; DRAM-cold its own scratch traffic is what holds it
// (docs/PERFORMANCE.md), so scratch is kept small:
// - scores as S^T = K x Q^T: the A tile is tk (16, or a block size of 8) keys x 32 dims, the B
//   tile q^T in VNNI order (a 32-bit pair of dims per query row), built once per item. bf16
//   queries go in exactly and the scale is applied to the fp32 scores; fp32 queries go in as
//   bf16 hi + lo, side by side as 2 x rows columns (one product; score_tile_dp's accuracy). The
//   S^T tiles are gathered into rows for the softmax; p goes into A tiles a key tile at a time.
// - p @ V with V as the B tile unchanged: a B row holds the 32 dims of one key, i.e. the pairs
//   (dim 2e, dim 2e + 1), so A rows whose even elements hold p and odd ones 0 sum p V over the
//   even dims, and rows with p in the odd elements over the odd dims. Each product does half
//   the work it could, but V needs no VNNI interleave: built with unpacklo/hi_epi16 through
//   memory (a tile load waits for the stores to drain), p @ V took 5x the time.
// - p keeps 16 of its 24 bits as bf16 hi + lo, near the AVX paths' fp32 p (p rounded to bf16
//   alone was reported to change greedy tokens; not measured here). A product costs by its A
//   rows, so the hi, lo, even and odd rows stack in one A tile where 4 x rows <= 16 (one
//   product per 32 dims), else in two.
// Tiles are not renamed: a load into a tile waits for the products that read it, so each pass
// has its own configuration with every operand in two tiles, tile t + 1 loading while tile t
// multiplies (one configuration for both passes, tiles reused: 0.83-0.85x of the AVX path's
// time cache-resident, against 0.72-0.81x; two loads of a configuration cost ~95 ns an item).
#if defined(PAGEDQ_AMX)
using pagedq_amx::amx_enabled;
using pagedq_amx::TileConfig;

// Keys of one tile: 16 for blocks of a multiple of 16, 8 for blocks of 8 (a tile never crosses a
// block); 0 otherwise (the AVX path runs).
inline int amx_tile_keys(const Layout& L) {
  return L.block_size % kTile == 0 ? kTile : L.block_size == 8 ? 8 : 0;
}

// Items of at most this many rows run on AMX (p's hi and lo rows stack in a tile of 16 rows).
constexpr int kAmxMaxRows = 8;

struct TileShapes {
  TileConfig c{};
  TileShapes() { c.palette_id = 1; }
  void set(int t, int rows, int colsb) {
    c.rows[t] = static_cast<uint8_t>(rows);
    c.colsb[t] = static_cast<uint16_t>(colsb);
  }
  void load() {
    PQ_MEMORY_BARRIER();
    _tile_loadconfig(&c);
  }
};

// Pass 1 of decode_item_amx: tiles 0, 1 S^T (keys x cols fp32: query rows, or hi and lo
// columns for fp32 queries), 2, 3 K (keys x 32 dims) of even tiles, 4-7 q^T of 32 dims each
// (16 pairs of dims x cols); with head_dim 64, 6 and 7 hold the K of odd tiles.
inline TileShapes amx_score_shapes(int cols, int tk, int c32) {
  TileShapes s;
  for (int t : {0, 1}) s.set(t, tk, cols * 4);
  for (int t : {2, 3}) s.set(t, tk, 64);
  for (int c = 0; c < 4; ++c) s.set(4 + c, 16, cols * 4);
  if (c32 <= 2)
    for (int t : {6, 7}) s.set(t, tk, 64);
  return s;
}

// Pass 2: 4 x rows <= 16 (stacked): tiles 0, 1 p (4 x rows x tk keys, see decode_item_amx) of
// even and odd key tiles, 2, 3 and 4, 5 V of 32 dims c and c + 1 (keys x 32 dims), 6, 7 the
// sums of dims c and c + 1 (4 x rows x 16). Else: 0, 1 p's even and odd rows (2 x rows each)
// of even key tiles, 2, 3 of odd ones, 4, 5 V, 6, 7 the sums over even and odd dims.
inline TileShapes amx_pv_shapes(int rows, int tk) {
  TileShapes s;
  if (4 * rows <= 16) {
    for (int t : {0, 1}) s.set(t, 4 * rows, 4 * tk);
    for (int t : {2, 3, 4, 5}) s.set(t, tk, 64);
    for (int t : {6, 7}) s.set(t, 4 * rows, 64);
  } else {
    for (int t : {0, 1, 2, 3}) s.set(t, 2 * rows, 4 * tk);
    for (int t : {4, 5}) s.set(t, tk, 64);
    for (int t : {6, 7}) s.set(t, 2 * rows, 64);
  }
  return s;
}

// Scratch of one thread for decode_item_amx, grown as needed.
struct AmxScratch {
  std::vector<float> st;     // S^T tiles: `cols` floats per key
  std::vector<uint32_t> q;   // q^T
  alignas(64) uint32_t a[2][4 * kAmxMaxRows * kTile];  // A tiles of p (see decode_item_amx)
  alignas(64) uint16_t v_last[2][kTile * 32];  // last V tiles of fewer keys, zero-padded
  alignas(64) float out[2][16 * 16];           // accumulator tiles
  int shapes_for = -1;       // rows * 64 + cols the cached shapes were made for
  TileShapes score, pv;
};

// S^T of one key tile into tile CT: K into KA and KB by turns, q^T in tiles 4-7. (Tile numbers
// are immediates in GCC's intrinsics.)
#define PQ_SCORE_TILE(CT, KA, KB, kp, rb, dst)                              \
  do {                                                                      \
    _tile_zero(CT);                                                         \
    _tile_loadd(KA, kp, rb);                                                \
    _tile_dpbf16ps(CT, KA, 4);                                              \
    if constexpr (C32 > 1) {                                                \
      _tile_loadd(KB, (kp) + 32, rb);                                       \
      _tile_dpbf16ps(CT, KB, 5);                                            \
    }                                                                       \
    if constexpr (C32 > 2) {                                                \
      _tile_loadd(KA, (kp) + 64, rb);                                       \
      _tile_dpbf16ps(CT, KA, 6);                                            \
    }                                                                       \
    if constexpr (C32 > 3) {                                                \
      _tile_loadd(KB, (kp) + 96, rb);                                       \
      _tile_dpbf16ps(CT, KB, 7);                                            \
    }                                                                       \
    _tile_stored(CT, dst, cols * 4);                                        \
  } while (0)

template <typename scalar_t, int D>
void decode_item_amx(const WorkItem& w, const Layout& L, int tk, const scalar_t* query,
                     const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                     const int64_t* block_table, const int64_t* qsl, const int64_t* seq_lens,
                     float qk_scale, scalar_t* out, float* partial_acc, float* partial_ml,
                     float* q_f, float* acc, float* m, float* l, std::vector<float>& scores,
                     AmxScratch& sc, const WorkItem* next) {
  static_assert(D % 32 == 0 && D <= 128, "AMX decodes take 1-4 tiles of 32 dims");
  constexpr int C32 = D / 32;
  constexpr bool kSplitQ = std::is_same_v<scalar_t, float>;
  const int G = L.group;
  const int rows = w.q_len * G;
  const bool stacked = 4 * rows <= 16;  // amx_pv_shapes' two layouts
  const int cols = kSplitQ ? 2 * rows : rows;
  if (sc.shapes_for != rows * 64 + cols) {
    sc.score = amx_score_shapes(cols, tk, C32);
    sc.pv = amx_pv_shapes(rows, tk);
    sc.shapes_for = rows * 64 + cols;
  }
  const int64_t q_start = qsl[w.req];
  const int64_t context_len = seq_lens[w.req] - (qsl[w.req + 1] - q_start);
  if constexpr (kSplitQ) {
    begin_item(w, L, D, query, q_start, qk_scale, q_f, acc, m, l);
  } else {  // q goes in as it is, and p @ V writes acc whole
    std::fill(m, m + rows, kNegInf);
    std::fill(l, l + rows, 0.f);
  }
  const int64_t first_pos = context_len + w.q_begin;
  const int64_t* bt_row = block_table + w.req * L.bt_sr;
  const int64_t head_off = static_cast<int64_t>(w.kv_head) * L.cache_head;
  const int num_keys = w.key_end - w.key_begin;
  const int num_tiles = (num_keys + tk - 1) / tk;
  const int last_keys = num_keys - (num_tiles - 1) * tk;
  const DecodeStream st = decode_stream(w, next, L);
  // The first row of the item's tile t (K or V): tiles never cross a block.
  const auto tile_base = [&](const c10::BFloat16* cache, int t) {
    const int key = w.key_begin + t * tk;
    return cache + bt_row[block_index(L, key) * L.bt_sb] * L.cache_block +
           block_offset(L, key) * L.cache_slot + head_off;
  };
  const int64_t row_bytes = L.cache_slot * static_cast<int64_t>(sizeof(c10::BFloat16));

  // q^T in VNNI order: word (c * 16 + kk) * cols + i holds dims 32c + 2kk, +1 of column i, which
  // is row i (bf16 queries, or the hi part of fp32 ones) or the lo part of row i - rows.
  const int q_words = C32 * 16 * cols;
  if (sc.q.size() < static_cast<size_t>(q_words)) sc.q.resize(q_words);
  uint32_t* qt = sc.q.data();
  for (int i = 0; i < rows; ++i) {
    if constexpr (kSplitQ) {  // q_f is scaled by qk_scale already
      for (int d = 0; d < D; d += 2) {
        uint32_t hi = 0, lo = 0;
        for (int e = 0; e < 2; ++e) {
          const float x = q_f[i * D + d + e];
          const c10::BFloat16 h(x);
          hi |= static_cast<uint32_t>(h.x) << (16 * e);
          lo |= static_cast<uint32_t>(c10::BFloat16(x - static_cast<float>(h)).x) << (16 * e);
        }
        const int word = ((d / 32) * 16 + (d % 32) / 2) * cols;
        qt[word + i] = hi;
        qt[word + rows + i] = lo;
      }
    } else {
      const scalar_t* src =
          query + (q_start + w.q_begin + i / G) * L.q_st + (w.kv_head * G + i % G) * L.q_sh;
      for (int d = 0; d < D; d += 2)
        std::memcpy(qt + ((d / 32) * 16 + (d % 32) / 2) * cols + i, src + d, sizeof(uint32_t));
    }
  }

  // Pass 1: S^T, `cols` floats per key. (A 64-byte row per key, 3 of its 16 floats used, made
  // S^T a 32 KiB write per 512 keys, which evicts K and V from L1: 64 decodes x 512, DRAM-cold,
  // ran at 0.92x of the AVX path's time against 0.89x packed.) K rows of a last tile past the
  // item's keys are the block's own (memory that exists), and their scores are never read.
  const int keys16 = (num_keys + kTile - 1) / kTile * kTile;
  if (sc.st.size() < static_cast<size_t>(keys16) * cols)
    sc.st.resize(static_cast<size_t>(keys16) * cols);
  float* St = sc.st.data();
  sc.score.load();
  _tile_loadd(4, qt, cols * 4);
  if constexpr (C32 > 1) _tile_loadd(5, qt + 16 * cols, cols * 4);
  if constexpr (C32 > 2) _tile_loadd(6, qt + 32 * cols, cols * 4);
  if constexpr (C32 > 3) _tile_loadd(7, qt + 48 * cols, cols * 4);
  for (int t = 0; t < num_tiles; ++t) {
    const c10::BFloat16* kp = tile_base(k_cache, t);
    const TileRows far = prefetch_ahead(st, L, D, block_table, k_cache, v_cache, t * tk,
                                        std::min(tk, num_keys - t * tk));
    float* dst = St + t * tk * cols;
    if (t % 2 == 0) {
      PQ_SCORE_TILE(0, 2, 3, kp, row_bytes, dst);
    } else if constexpr (C32 <= 2) {
      PQ_SCORE_TILE(1, 6, 7, kp, row_bytes, dst);
    } else {
      PQ_SCORE_TILE(1, 2, 3, kp, row_bytes, dst);
    }
    prefetch_rows<1>(far, 0, far.rows);
  }

  // Per row: S^T gathered into a row in log2 units (hi + lo columns for fp32 queries) and its
  // max over the visible keys; then p = 2^(s - max) in place (0 past them) and its sum. p goes
  // into A tiles one key tile at a time in pass 2, into two buffers by turns, each built while
  // the other's products run. (All of an item's A tiles built here, 24 KiB per 512 keys that
  // push K and V out of L1: 64 decodes x 512 DRAM-cold ran at 0.89x of the AVX path's time,
  // against 0.85-0.86x.)
  const int stride = keys16 + kTile;
  if (scores.size() < static_cast<size_t>(rows) * stride)
    scores.resize(static_cast<size_t>(rows) * stride);
  float* S = scores.data();
  const __m512i gather_idx = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(cols));
  const __m512 vscale = _mm512_set1_ps(kSplitQ ? 1.f : qk_scale);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int i = 0; i < rows; ++i) {
    float* si = S + i * stride;
    const int64_t pos = first_pos + i / G;
    const int64_t limit = pos + 1 - w.key_begin;
    const int visible = static_cast<int>(std::clamp<int64_t>(limit, 0, num_keys));
    // keys [lo, visible) of the item: below lo lies outside the row's sliding window
    const int lo = static_cast<int>(
        std::clamp<int64_t>(window_start(L, pos) - w.key_begin, 0, visible));
    __m512 vmx = _mm512_set1_ps(kNegInf);
    for (int j = 0; j < visible; j += kTile) {
      __m512 s = _mm512_i32gather_ps(gather_idx, St + j * cols + i, 4);
      if constexpr (kSplitQ)
        s = _mm512_add_ps(s, _mm512_i32gather_ps(gather_idx, St + j * cols + rows + i, 4));
      s = _mm512_mul_ps(s, vscale);
      if (L.cap > 0.f)
        s = static_cast<__m512>(tanh_v(static_cast<vfloat>(s)) * L.cap);
      const __mmask16 in = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(visible - j)) &
                           _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(lo - j));
      s = _mm512_mask_blend_ps(in, _mm512_set1_ps(kNegInf), s);
      _mm512_storeu_ps(si + j, s);
      vmx = _mm512_max_ps(vmx, s);
    }
    // a row that sees nothing of this item: p = 0, m stays -inf and l 0
    const float mx = visible > lo ? _mm512_reduce_max_ps(vmx) : 0.f;
    const __m512 vmax_row = _mm512_set1_ps(mx);
    __m512 vsum = _mm512_setzero_ps();
    for (int j = 0; j < num_tiles * tk; j += kTile) {
      __m512 p = _mm512_setzero_ps();
      if (j < visible) {
        const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(si + j), vmax_row);
        p = static_cast<__m512>(exp2_neg_v(static_cast<vfloat>(x)));
        vsum = _mm512_add_ps(vsum, p);
      }
      _mm512_storeu_ps(si + j, p);
    }
    if (visible > lo) {
      m[i] = mx;
      l[i] = _mm512_reduce_add_ps(vsum);
    }
  }
  // The A tile of key tile t: 4 x rows rows of tk 32-bit words, row i p hi of query row i in
  // the low halves (even elements), row rows + i p lo, rows 2 rows + i and 3 rows + i the same
  // in the high halves (odd elements).
  const auto build_a = [&](int t, uint32_t* tile) {
    PQ_MEMORY_BARRIER();  // after the tile loads that read this buffer before
    const __mmask16 keys = tk == kTile ? 0xFFFF : (1u << tk) - 1;
    for (int i = 0; i < rows; ++i) {
      const __m512 p = _mm512_maskz_loadu_ps(keys, S + i * stride + t * tk);
      const __m256bh hi = _mm512_cvtneps_pbh(p);
      const __m512i hi_even = _mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(hi));
      const __m512i hi_odd = _mm512_slli_epi32(hi_even, 16);  // hi as an fp32
      const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(p, _mm512_castsi512_ps(hi_odd)));
      const __m512i lo_even = _mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(lo));
      const __m512i parts[4] = {hi_even, lo_even, hi_odd, _mm512_slli_epi32(lo_even, 16)};
      for (int part = 0; part < 4; ++part)
        _mm512_mask_storeu_epi32(tile + (part * rows + i) * tk, keys, parts[part]);
    }
    PQ_MEMORY_BARRIER();  // before the tile loads that read it
  };
  uint32_t* abuf[2] = {sc.a[0], sc.a[1]};

  // Pass 2: acc = p @ V, per 32 dims c. sc.out gets, per c, the rows in p's order (even hi,
  // even lo, odd hi, odd lo), which finish_dims adds up and puts back in order.
  const auto v_tile = [&](int t, int c, int buf) -> const c10::BFloat16* {
    const c10::BFloat16* vp = tile_base(v_cache, t) + 32 * c;
    if (t < num_tiles - 1 || last_keys == tk) return vp;
    // V rows past the item's keys may hold anything (0 x NaN is NaN): zeros instead.
    std::memset(sc.v_last[buf], 0, sizeof(sc.v_last[buf]));
    for (int j = 0; j < last_keys; ++j)
      std::memcpy(sc.v_last[buf] + j * 32, vp + j * L.cache_slot, 64);
    PQ_MEMORY_BARRIER();
    return reinterpret_cast<const c10::BFloat16*>(sc.v_last[buf]);
  };
  const auto v_stride = [&](int t) -> int64_t {
    return t < num_tiles - 1 || last_keys == tk ? row_bytes : 64;
  };
  const __m512i even_idx =
      _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i odd_idx =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const auto finish_dims = [&](const float* o, int c) {
    for (int i = 0; i < rows; ++i) {
      const __m512 even = _mm512_add_ps(_mm512_load_ps(o + i * 16),
                                        _mm512_load_ps(o + (rows + i) * 16));
      const __m512 odd = _mm512_add_ps(_mm512_load_ps(o + (2 * rows + i) * 16),
                                       _mm512_load_ps(o + (3 * rows + i) * 16));
      _mm512_storeu_ps(acc + i * D + 32 * c, _mm512_permutex2var_ps(even, even_idx, odd));
      _mm512_storeu_ps(acc + i * D + 32 * c + 16, _mm512_permutex2var_ps(even, odd_idx, odd));
    }
  };
  const auto prefetch_v = [&](int t) {
    const TileRows far = prefetch_ahead(st, L, D, block_table, k_cache, v_cache,
                                        st.half + t * tk, std::min(tk, num_keys - t * tk));
    prefetch_rows<1>(far, 0, far.rows);
  };
  sc.pv.load();
  if (stacked) {
    for (int c = 0; c < C32; c += 2) {
      const bool pair = c + 1 < C32;
      _tile_zero(6);
      _tile_zero(7);
      build_a(0, abuf[0]);
      for (int t = 0; t < num_tiles; ++t) {
        if (c == 0) prefetch_v(t);
        const uint32_t* pt = abuf[t % 2];
        if (t % 2 == 0) {
          _tile_loadd(0, pt, tk * 4);
          _tile_loadd(2, v_tile(t, c, 0), v_stride(t));
          _tile_dpbf16ps(6, 0, 2);
          if (pair) {
            _tile_loadd(3, v_tile(t, c + 1, 1), v_stride(t));
            _tile_dpbf16ps(7, 0, 3);
          }
        } else {
          _tile_loadd(1, pt, tk * 4);
          _tile_loadd(4, v_tile(t, c, 0), v_stride(t));
          _tile_dpbf16ps(6, 1, 4);
          if (pair) {
            _tile_loadd(5, v_tile(t, c + 1, 1), v_stride(t));
            _tile_dpbf16ps(7, 1, 5);
          }
        }
        if (t + 1 < num_tiles) build_a(t + 1, abuf[(t + 1) % 2]);  // while tile t multiplies
      }
      _tile_stored(6, sc.out[0], 64);
      finish_dims(sc.out[0], c);
      if (pair) {
        _tile_stored(7, sc.out[1], 64);
        finish_dims(sc.out[1], c + 1);
      }
    }
  } else {
    for (int c = 0; c < C32; ++c) {
      _tile_zero(6);
      _tile_zero(7);
      build_a(0, abuf[0]);
      for (int t = 0; t < num_tiles; ++t) {
        if (c == 0) prefetch_v(t);
        const uint32_t* pt = abuf[t % 2];
        const uint32_t* pt_odd = pt + 2 * rows * tk;
        if (t % 2 == 0) {
          _tile_loadd(4, v_tile(t, c, 0), v_stride(t));
          _tile_loadd(0, pt, tk * 4);
          _tile_loadd(1, pt_odd, tk * 4);
          _tile_dpbf16ps(6, 0, 4);
          _tile_dpbf16ps(7, 1, 4);
        } else {
          _tile_loadd(5, v_tile(t, c, 0), v_stride(t));
          _tile_loadd(2, pt, tk * 4);
          _tile_loadd(3, pt_odd, tk * 4);
          _tile_dpbf16ps(6, 2, 5);
          _tile_dpbf16ps(7, 3, 5);
        }
        if (t + 1 < num_tiles) build_a(t + 1, abuf[(t + 1) % 2]);  // while tile t multiplies
      }
      _tile_stored(6, sc.out[0], 64);
      _tile_stored(7, sc.out[0] + 2 * rows * 16, 64);
      finish_dims(sc.out[0], c);
    }
  }
  finish_item(w, L, D, q_start, acc, m, l, out, partial_acc, partial_ml);
}
#undef PQ_SCORE_TILE
#endif  // AMX

// kOptions: the layer has a sliding window or a soft cap. A separate instantiation, because the
// plain one is what most layers run: with the options' branches inside its row-block loop, a
// 6 x 300 prefill took 1.19x the time (1 thread, bench/attention_cpu.py --against).
template <typename scalar_t, typename cache_t, int D, bool kOptions>
void attend_item_vec(const WorkItem& w, const Layout& L, const scalar_t* query,
                     const cache_t* k_cache, const cache_t* v_cache, const int64_t* block_table,
                     const int64_t* qsl, const int64_t* seq_lens, float qk_scale, scalar_t* out,
                     float* partial_acc, float* partial_ml, float* q_f, float* acc, float* m,
                     float* l, float* l_lanes, float* kv_tile) {
  static_assert(D % kLanes == 0, "the vector path needs head_dim % kLanes == 0");
  constexpr int C = D / kLanes;
  const int G = L.group;
  const int rows = w.q_len * G;
  const int64_t q_start = qsl[w.req];
  const int64_t query_len = qsl[w.req + 1] - q_start;
  const int64_t context_len = seq_lens[w.req] - query_len;

  begin_item(w, L, D, query, q_start, qk_scale, q_f, acc, m, l);
  // Row sums lane-wise (softmax_rows), for every row a row block touches.
  std::fill(l_lanes, l_lanes + (rows + kRowBlock - 1) / kRowBlock * kRowBlock * kLanes, 0.f);
  const int64_t first_pos = context_len + w.q_begin;
  const int64_t* bt_row = block_table + w.req * L.bt_sr;
  const int64_t head_off = static_cast<int64_t>(w.kv_head) * L.cache_head;
  float* k_tile = kv_tile;  // bf16 caches: the tile's K and V converted once, used by all rows
  float* v_tile = kv_tile + kTile * D;
  float* k_t = kv_tile + 2 * kTile * D;  // K^T of the tile, D x kTile

  int key = w.key_begin;
  while (key < w.key_end) {
    const int in_block = block_offset(L, key);
    const int n = std::min({w.key_end - key, L.block_size - in_block, kTile});
    const int64_t block = bt_row[block_index(L, key) * L.bt_sb];
    const int64_t base = block * L.cache_block + in_block * L.cache_slot + head_off;
    const cache_t* kp = k_cache + base;
    const cache_t* vp = v_cache + base;
    // The next tile's rows into L1, so that its misses overlap this tile's compute.
    for (const cache_t* cache : {k_cache, v_cache}) {
      const TileRows next = tile_rows(w, L, D, block_table, cache, key + n);
      prefetch_rows<3>(next, 0, next.rows);
    }
    // ... and rows further ahead into L2, which other hosts rewarded
    const int far = key + n + (kFarPrefetchTiles - 1) * kTile;
    for (const cache_t* cache : {k_cache, v_cache}) {
      const TileRows ahead = tile_rows(w, L, D, block_table, cache, far);
      prefetch_rows<1>(ahead, 0, ahead.rows);
    }
    const float* kf;
    const float* vf;
    int64_t kv_stride;
    if constexpr (std::is_same_v<cache_t, float>) {
      kf = kp;
      vf = vp;
      kv_stride = L.cache_slot;
    } else {
      for (int j = 0; j < n; ++j)
        for (int c = 0; c < C; ++c) {
          storev(k_tile + j * D + c * kLanes, loadv(kp + j * L.cache_slot + c * kLanes));
          storev(v_tile + j * D + c * kLanes, loadv(vp + j * L.cache_slot + c * kLanes));
        }
      kf = k_tile;
      vf = v_tile;
      kv_stride = D;
    }
    const bool needs_mask = key + n - 1 > first_pos;
    // the tile starts below the last row's window (never without a window)
    const bool needs_window = kOptions && key < window_start(L, first_pos + w.q_len - 1);

    // Prefill: K^T of the tile (zero past n): a row's scores are then D broadcast-FMAs.
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < kTileVecs; ++h) {
        vfloat r[kLanes];
        for (int j = 0; j < kLanes; ++j) {
          const int key_j = h * kLanes + j;
          r[j] = key_j < n ? loadv(kf + key_j * kv_stride + c * kLanes) : vfloat{};
        }
        transpose_lanes(r);
        for (int d = 0; d < kLanes; ++d) storev(k_t + (c * kLanes + d) * kTile + h * kLanes, r[d]);
      }
    for (int i0 = 0; i0 < rows; i0 += kRowBlock) {
      vfloat s[kRowBlock][kTileVecs] = {};
      const float* qb = q_f + i0 * D;
      for (int d = 0; d < D; ++d) {
        vfloat kd[kTileVecs];
#pragma GCC unroll 16
        for (int v = 0; v < kTileVecs; ++v) kd[v] = loadv(k_t + d * kTile + v * kLanes);
#pragma GCC unroll 16
        for (int r = 0; r < kRowBlock; ++r) {
          const float qv = qb[r * D + d];
#pragma GCC unroll 16
          for (int v = 0; v < kTileVecs; ++v) s[r][v] += qv * kd[v];
        }
      }
      if (kOptions && L.cap > 0.f)
        for (int r = 0; r < kRowBlock; ++r)
          for (int v = 0; v < kTileVecs; ++v) s[r][v] = tanh_v(s[r][v]) * L.cap;
      alignas(64) float p[kRowBlock][kTile];
      float alpha[kRowBlock];
      int limit[kRowBlock], start[kRowBlock];
      int jmax = 0;
      // Row i is query token i / G: counted along, not divided (an idiv per row and tile).
      for (int r = 0, tok = i0 / G, head = i0 % G; r < kRowBlock; ++r) {
        const int64_t visible = i0 + r >= rows ? 0 : needs_mask ? first_pos + tok - key + 1 : n;
        limit[r] = static_cast<int>(std::clamp<int64_t>(visible, 0, n));
        jmax = std::max(jmax, limit[r]);
        if (kOptions && needs_window)
          start[r] = static_cast<int>(
              std::clamp<int64_t>(window_start(L, first_pos + tok) - key, 0, limit[r]));
        if (++head == G) head = 0, ++tok;
      }
      if (kOptions && needs_window)
        softmax_rows<kRowBlock, kOptions>(s, start, limit, m + i0, l_lanes + i0 * kLanes, p,
                                          alpha);
      else
        softmax_rows<kRowBlock, false>(s, start, limit, m + i0, l_lanes + i0 * kLanes, p, alpha);
      static_assert(kRowBlock % kPvRows == 0, "p @ V passes split the row block evenly");
      for (int r0 = 0; r0 < kRowBlock; r0 += kPvRows)
        accumulate_pv<D, kPvRows, pass_vecs(C, kPvVecs)>(acc + (i0 + r0) * D, p[r0], kTile,
                                                         alpha + r0, vf, kv_stride, jmax);
    }
    key += n;
  }

  for (int i = 0; i < rows; ++i) l[i] = sum_lanes(loadv(l_lanes + i * kLanes));
  finish_item(w, L, D, q_start, acc, m, l, out, partial_acc, partial_ml);
}

template <typename scalar_t>
void merge_group(const SplitGroup& g, const Layout& L, const int64_t* qsl,
                 const float* partial_acc, const float* partial_ml, scalar_t* out) {
  const int D = L.head_dim;
  const int rows = g.q_len * L.group;
  const int64_t chunk_rows = rows;  // each chunk owns `rows` consecutive partial rows
  std::vector<float> o(D);
  for (int i = 0; i < rows; ++i) {
    const float sink = L.sinks != nullptr ? L.sinks[g.kv_head * L.group + i % L.group] : kNegInf;
    float m_max = sink;
    for (int c = 0; c < g.num_chunks; ++c)
      m_max = std::max(m_max, partial_ml[2 * (g.partial + c * chunk_rows + i)]);
    std::fill(o.begin(), o.end(), 0.f);
    float l_sum = L.sinks != nullptr ? exp2_neg(sink - m_max) : 0.f;
    for (int c = 0; c < g.num_chunks; ++c) {
      const int64_t r = g.partial + c * chunk_rows + i;
      const float mc = partial_ml[2 * r];
      if (mc == kNegInf) continue;
      const float w = exp2_neg(mc - m_max);
      l_sum += w * partial_ml[2 * r + 1];
      const float* a = partial_acc + r * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) o[d] += w * a[d];
    }
    const float inv = l_sum > 0.f ? 1.f / l_sum : 0.f;
    const int t = g.q_begin + i / L.group;
    const int h = g.kv_head * L.group + i % L.group;
    scalar_t* dst = out + (qsl[g.req] + t) * L.o_st + h * L.o_sh;
    for (int d = 0; d < D; ++d) dst[d] = from_float<scalar_t>(o[d] * inv);
  }
}

template <typename scalar_t, typename cache_t, int DT>
void run(const std::vector<WorkItem>& items, const std::vector<SplitGroup>& groups,
         const Layout& L, const at::Tensor& query, const at::Tensor& kv_cache,
         const at::Tensor& block_table, const at::Tensor& qsl, const at::Tensor& seq_lens,
         float qk_scale, at::Tensor& out, int64_t num_partial_rows) {
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const cache_t* k_ptr = kv_cache.data_ptr<cache_t>();
  const cache_t* v_ptr = k_ptr + kv_cache.stride(0);
  const int64_t* bt_ptr = block_table.data_ptr<int64_t>();
  const int64_t* qsl_ptr = qsl.data_ptr<int64_t>();
  const int64_t* sl_ptr = seq_lens.data_ptr<int64_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int D = L.head_dim;
  std::vector<float> partial_acc(num_partial_rows * D);
  std::vector<float> partial_ml(num_partial_rows * 2);
  // rounded up to whole row blocks: the vector path reads (and ignores) rows past the tile
  const int max_rows = (std::max(kMaxTileRows, L.group) + kRowBlock - 1) / kRowBlock * kRowBlock;

  const bool options = L.window > 0 || L.cap > 0.f;  // sinks act only when an item ends
  // Items are sorted by cost, largest first; threads take the next one from a shared counter.
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t num_workers = std::min<int64_t>(at::get_num_threads(), num_items);
#if defined(PAGEDQ_AMX)
  constexpr bool kAmxShape = std::is_same_v<cache_t, c10::BFloat16> && DT > 0 && DT % 32 == 0;
  const int amx_keys = kAmxShape && amx_enabled() ? amx_tile_keys(L) : 0;
#endif
  at::parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch(static_cast<size_t>(max_rows) * (2 * D + kKeyTile + 2) +
                               2 * kKeyTile * D);
    float* q_f = scratch.data();
    float* acc = q_f + max_rows * D;
    float* score = acc + max_rows * D;  // the scalar path's scores; the vector path's lane sums
    float* m = score + max_rows * kKeyTile;
    float* l = m + max_rows;
    float* kv_tile = l + max_rows;
    std::vector<float> decode_scores;
#if defined(PAGEDQ_AMX)
    std::unique_ptr<AmxScratch> amx;
    bool amx_used = false;  // this thread configured its tiles
#endif
    // Each thread claims its next item before it starts the current one, so that the decode
    // path can prefetch that item's first tiles while it finishes this one.
    for (int64_t k = next.fetch_add(1); k < num_items;) {
      const int64_t k_next = next.fetch_add(1);
      const WorkItem* following = k_next < num_items ? &items[k_next] : nullptr;
      if constexpr (DT > 0 && DT % kLanes == 0) {
#if defined(PAGEDQ_AMX)
        if constexpr (kAmxShape) {
          const int rows = items[k].q_len * L.group;
          if (amx_keys > 0 && rows <= kAmxMaxRows && L.alibi == nullptr) {
            amx_used = true;
            if (!amx) amx = std::make_unique<AmxScratch>();
            decode_item_amx<scalar_t, DT>(items[k], L, amx_keys, q_ptr, k_ptr, v_ptr, bt_ptr,
                                          qsl_ptr, sl_ptr, qk_scale, o_ptr, partial_acc.data(),
                                          partial_ml.data(), q_f, acc, m, l, decode_scores,
                                          *amx, following);
            k = k_next;
            continue;
          }
        }
#endif
        if (items[k].q_len * L.group < kBlockedMinRows) {
          decode_item<scalar_t, cache_t, DT>(items[k], L, q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr,
                                             sl_ptr, qk_scale, o_ptr, partial_acc.data(),
                                             partial_ml.data(), q_f, acc, m, l, decode_scores,
                                             kv_tile, following);
          k = k_next;
          continue;
        }
        if (L.alibi != nullptr)
          attend_item<scalar_t, cache_t, DT>(items[k], L, q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr,
                                             sl_ptr, qk_scale, o_ptr, partial_acc.data(),
                                             partial_ml.data(), q_f, acc, score, m, l, kv_tile);
        else if (options)
          attend_item_vec<scalar_t, cache_t, DT, true>(
              items[k], L, q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, sl_ptr, qk_scale, o_ptr,
              partial_acc.data(), partial_ml.data(), q_f, acc, m, l, score, kv_tile);
        else
          attend_item_vec<scalar_t, cache_t, DT, false>(
              items[k], L, q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, sl_ptr, qk_scale, o_ptr,
              partial_acc.data(), partial_ml.data(), q_f, acc, m, l, score, kv_tile);
      } else {
        attend_item<scalar_t, cache_t, DT>(items[k], L, q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr,
                                           sl_ptr, qk_scale, o_ptr, partial_acc.data(),
                                           partial_ml.data(), q_f, acc, score, m, l, kv_tile);
      }
      k = k_next;
    }
#if defined(PAGEDQ_AMX)
    if (amx_used) _tile_release();
#endif
  });
  if (!groups.empty()) {
    at::parallel_for(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t b, int64_t e) {
      for (int64_t g = b; g < e; ++g)
        merge_group<scalar_t>(groups[g], L, qsl_ptr, partial_acc.data(), partial_ml.data(),
                              o_ptr);
    });
  }
}

template <typename scalar_t, typename cache_t, typename... Args>
void dispatch_dim(int head_dim, Args&&... args) {
  switch (head_dim) {
    case 64:
      return run<scalar_t, cache_t, 64>(args...);
    case 80:
      return run<scalar_t, cache_t, 80>(args...);
    case 96:
      return run<scalar_t, cache_t, 96>(args...);
    case 128:
      return run<scalar_t, cache_t, 128>(args...);
    default:
      return run<scalar_t, cache_t, 0>(args...);
  }
}

void unified_attention(const at::Tensor& query_in, const at::Tensor& kv_cache,
                       const at::Tensor& query_start_loc, const at::Tensor& seq_lens_in,
                       const at::Tensor& block_table_in, double scale, at::Tensor& out,
                       int64_t kv_split_size, int64_t sliding_window, double logits_soft_cap,
                       const std::optional<at::Tensor>& sinks_in,
                       const std::optional<at::Tensor>& alibi_in) {
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 1 (0: none), got ", sliding_window);
  TORCH_CHECK(logits_soft_cap >= 0, "logits_soft_cap must be > 0 (0: none), got ",
              logits_soft_cap);
  TORCH_CHECK(query_in.dim() == 3, "query must be [num_tokens, num_heads, head_dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(kv_cache.stride(4) == 1, "kv_cache rows (head_dim) must be contiguous");
  TORCH_CHECK(out.sizes() == query_in.sizes() && out.scalar_type() == query_in.scalar_type(),
              "out must have the query's shape and dtype");
  const int64_t num_tokens = query_in.size(0), num_heads = query_in.size(1);
  const int64_t head_dim = query_in.size(2);
  const int64_t block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == head_dim && num_heads % num_kv_heads == 0,
              "query ", query_in.sizes(), " does not fit kv_cache ", kv_cache.sizes(),
              ": head_dim must match and num_heads must be a multiple of num_kv_heads");
  const int64_t num_seqs = seq_lens_in.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1, "query_start_loc needs num_seqs + 1 = ",
              num_seqs + 1, " entries, got ", query_start_loc.size(0));
  if (num_tokens == 0 || num_seqs == 0) return;
  // Sinks in log2 units, as the scores.
  at::Tensor sinks;
  if (sinks_in.has_value()) {
    TORCH_CHECK(sinks_in->dim() == 1 && sinks_in->size(0) == num_heads,
                "sinks must be [num_heads] = [", num_heads, "], got ", sinks_in->sizes());
    sinks = (sinks_in->to(at::kFloat) * kLog2e).contiguous();
  }
  at::Tensor alibi;  // slopes in log2 units, as the scores
  if (alibi_in.has_value()) {
    TORCH_CHECK(alibi_in->dim() == 1 && alibi_in->size(0) == num_heads,
                "alibi_slopes must be [num_heads] = [", num_heads, "], got ", alibi_in->sizes());
    alibi = (alibi_in->to(at::kFloat) * kLog2e).contiguous();
  }
  const int64_t window = sliding_window;

  const at::Tensor query = query_in.stride(2) == 1 ? query_in : query_in.contiguous();
  at::Tensor target = out.stride(2) == 1 ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
  const at::Tensor qsl = query_start_loc.to(at::kLong).contiguous();
  const at::Tensor seq_lens = seq_lens_in.to(at::kLong).contiguous();
  const at::Tensor block_table = block_table_in.to(at::kLong);
  const int64_t* qsl_p = qsl.data_ptr<int64_t>();
  const int64_t* sl_p = seq_lens.data_ptr<int64_t>();

  const int group = static_cast<int>(num_heads / num_kv_heads);
  const int tile_tokens = std::max(1, kMaxTileRows / group);

  // Items without splitting, and the total number of keys they read.
  std::vector<WorkItem> base;
  int64_t total_keys = 0;
  for (int64_t r = 0; r < num_seqs; ++r) {
    const int64_t q_len = qsl_p[r + 1] - qsl_p[r];
    const int64_t context = sl_p[r] - q_len;
    TORCH_CHECK(q_len >= 0 && context >= 0, "request ", r, ": seq_len ", sl_p[r],
                " is shorter than its ", q_len, " query tokens");
    TORCH_CHECK(sl_p[r] <= block_table.size(1) * block_size, "request ", r, ": seq_len ",
                sl_p[r], " exceeds its block table of ", block_table.size(1), " blocks");
    for (int64_t t = 0; t < q_len; t += tile_tokens) {
      const int64_t n = std::min<int64_t>(tile_tokens, q_len - t);
      const int64_t key_end = context + t + n;
      // A sliding window starts the item at the block of its first row's first key: blocks
      // before it are never read, so a long decode costs its window only. (Whole blocks keep
      // every tile inside one block, which the AMX and prefetch paths rely on.)
      const int64_t key_begin =
          window > 0 ? std::max<int64_t>(0, context + t - window + 1) / block_size * block_size
                     : 0;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        base.push_back({(int32_t)r, (int32_t)h, (int32_t)t, (int32_t)n, (int32_t)key_begin,
                        (int32_t)key_end, -1, (key_end - key_begin) * n});
        total_keys += key_end - key_begin;
      }
    }
  }
  const int64_t threads = at::get_num_threads();
  int64_t chunk = kv_split_size;
  if (chunk <= 0) {  // auto: enough chunks for ~4 items per thread, never below 512 keys
    chunk = std::max<int64_t>(512, (total_keys + 4 * threads - 1) / (4 * threads));
  }
  chunk = (chunk + block_size - 1) / block_size * block_size;

  std::vector<WorkItem> items;
  std::vector<SplitGroup> groups;
  items.reserve(base.size());
  int64_t partial_rows = 0;
  for (const WorkItem& b : base) {
    const int64_t num_chunks = (b.key_end - b.key_begin + chunk - 1) / chunk;
    if (num_chunks <= 1) {
      items.push_back(b);
      continue;
    }
    const int64_t rows = static_cast<int64_t>(b.q_len) * group;
    groups.push_back({b.req, b.kv_head, b.q_begin, b.q_len, partial_rows, (int32_t)num_chunks});
    for (int64_t c = 0; c < num_chunks; ++c) {
      WorkItem w = b;
      w.key_begin = static_cast<int32_t>(b.key_begin + c * chunk);
      w.key_end = static_cast<int32_t>(std::min<int64_t>(b.key_end, b.key_begin + (c + 1) * chunk));
      w.partial = partial_rows + c * rows;
      w.cost = static_cast<int64_t>(w.key_end - w.key_begin) * b.q_len;
      items.push_back(w);
    }
    partial_rows += num_chunks * rows;
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

  Layout L;
  L.num_heads = static_cast<int>(num_heads);
  L.num_kv_heads = static_cast<int>(num_kv_heads);
  L.group = group;
  L.head_dim = static_cast<int>(head_dim);
  L.block_size = static_cast<int>(block_size);
  L.q_st = query.stride(0);
  L.q_sh = query.stride(1);
  L.o_st = target.stride(0);
  L.o_sh = target.stride(1);
  L.bt_sr = block_table.stride(0);
  L.bt_sb = block_table.stride(1);
  L.cache_block = kv_cache.stride(1);
  L.cache_slot = kv_cache.stride(2);
  L.cache_head = kv_cache.stride(3);
  L.block_shift = (block_size & (block_size - 1)) == 0 ? __builtin_ctzll(block_size) : -1;
  L.window = static_cast<int>(window);
  L.cap = static_cast<float>(logits_soft_cap) * kLog2e;
  L.sinks = sinks.defined() ? sinks.data_ptr<float>() : nullptr;
  L.alibi = alibi.defined() ? alibi.data_ptr<float>() : nullptr;
  // Soft-capped scores are tanh of q . k x scale / cap, times cap in log2 units (L.cap);
  // otherwise the scores are q . k x scale in log2 units straight away.
  const float qk_scale = logits_soft_cap > 0 ? static_cast<float>(scale / logits_soft_cap)
                                             : static_cast<float>(scale) * kLog2e;

  const auto qt = query.scalar_type(), ct = kv_cache.scalar_type();
#define PAGEDQ_RUN(S, C)                                                                     \
  dispatch_dim<S, C>(L.head_dim, items, groups, L, query, kv_cache, block_table, qsl, seq_lens, \
                     qk_scale, target, partial_rows)
  if (qt == at::kFloat && ct == at::kFloat) {
    PAGEDQ_RUN(float, float);
  } else if (qt == at::kFloat && ct == at::kBFloat16) {
    PAGEDQ_RUN(float, c10::BFloat16);
  } else if (qt == at::kBFloat16 && ct == at::kBFloat16) {
    PAGEDQ_RUN(c10::BFloat16, c10::BFloat16);
  } else if (qt == at::kBFloat16 && ct == at::kFloat) {
    PAGEDQ_RUN(c10::BFloat16, float);
  } else {
    TORCH_CHECK(false, "pagedq::unified_attention supports float32 and bfloat16, got query ", qt,
                " and kv_cache ", ct);
  }
#undef PAGEDQ_RUN
  if (!target.is_same(out)) out.copy_(target);
}

template <typename src_t, typename cache_t>
void write_rows(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                const int64_t* slots, int64_t num_tokens) {
  const int64_t kv_heads = key.size(1), D = key.size(2);
  const int64_t block_size = kv_cache.size(2);
  const int64_t cs_block = kv_cache.stride(1), cs_slot = kv_cache.stride(2),
                cs_head = kv_cache.stride(3);
  const src_t* k = key.data_ptr<src_t>();
  const src_t* v = value.data_ptr<src_t>();
  cache_t* kc = kv_cache.data_ptr<cache_t>();
  cache_t* vc = kc + kv_cache.stride(0);
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), vs0 = value.stride(0),
                vs1 = value.stride(1);
  at::parallel_for(0, num_tokens, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const src_t* ks = k + t * ks0 + h * ks1;
        const src_t* vs = v + t * vs0 + h * vs1;
        const int64_t at = (slot / block_size) * cs_block + (slot % block_size) * cs_slot + h * cs_head;
        cache_t* kd = kc + at;
        cache_t* vd = vc + at;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          kd[d] = from_float<cache_t>(to_float(ks[d]));
          vd[d] = from_float<cache_t>(to_float(vs[d]));
        }
      }
    }
  });
}

void write_kv(const at::Tensor& key_in, const at::Tensor& value_in, at::Tensor& kv_cache,
              const at::Tensor& slot_mapping_in) {
  TORCH_CHECK(key_in.dim() == 3 && key_in.sizes() == value_in.sizes(),
              "key and value must both be [num_tokens, num_kv_heads, head_dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.stride(4) == 1 &&
                  kv_cache.size(3) == key_in.size(1) && kv_cache.size(4) == key_in.size(2),
              "kv_cache ", kv_cache.sizes(), " does not fit key ", key_in.sizes());
  TORCH_CHECK(key_in.scalar_type() == value_in.scalar_type(), "key and value dtypes differ");
  const at::Tensor key = key_in.stride(2) == 1 ? key_in : key_in.contiguous();
  const at::Tensor value = value_in.stride(2) == 1 ? value_in : value_in.contiguous();
  const at::Tensor slots = slot_mapping_in.to(at::kLong).contiguous();
  const int64_t num_tokens = key.size(0);
  TORCH_CHECK(slots.size(0) == num_tokens, "slot_mapping needs ", num_tokens, " entries");
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(s[t] < num_slots, "slot ", s[t], " out of range (", num_slots, " slots)");
  const auto st = key.scalar_type(), ct = kv_cache.scalar_type();
  if (st == at::kFloat && ct == at::kFloat) {
    write_rows<float, float>(key, value, kv_cache, s, num_tokens);
  } else if (st == at::kFloat && ct == at::kBFloat16) {
    write_rows<float, c10::BFloat16>(key, value, kv_cache, s, num_tokens);
  } else if (st == at::kBFloat16 && ct == at::kBFloat16) {
    write_rows<c10::BFloat16, c10::BFloat16>(key, value, kv_cache, s, num_tokens);
  } else if (st == at::kBFloat16 && ct == at::kFloat) {
    write_rows<c10::BFloat16, float>(key, value, kv_cache, s, num_tokens);
  } else {
    TORCH_CHECK(false, "pagedq::write_kv supports float32 and bfloat16, got ", st, " -> ", ct);
  }
}

// True when bf16 decodes run on AMX here: built for a CPU with AMX, the OS granted its state,
// and PAGEDQ_CPU_AMX is not 0.
bool amx_decode_available() {
#if defined(PAGEDQ_AMX)
  return amx_enabled();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(pagedq, m) {
  m.def(
      "unified_attention(Tensor query, Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, "
      "Tensor block_table, float scale, Tensor(a!) out, int kv_split_size, int sliding_window, "
      "float logits_soft_cap, Tensor? sinks, Tensor? alibi_slopes) -> ()");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("amx_decode_available() -> bool", &amx_decode_available);
}

TORCH_LIBRARY_IMPL(pagedq, CPU, m) {
  m.impl("unified_attention", &unified_attention);
  m.impl("write_kv", &write_kv);
}
