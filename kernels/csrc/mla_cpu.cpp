// Multi-head latent attention (DeepSeek MLA) for CPUs over a paged latent cache, registered as
// pagedq::mla_attention and pagedq::write_latent: the twins of kernels/mla.py.
//
// Each cache row is [latent (L) | rope key (R)]; a query row is [q_latent | q_pe]. The score of
// a row against a key is one dot product over L + R, and the value is the key's first L values,
// so one read of a cache row serves every head: it is MQA with a 576-wide key. Work items are
// (request, tile of query tokens, block of up to 16 heads), at most 128 rows, taken from a shared
// counter longest first; an item walks its visible keys in tiles of 16 with an online softmax
// in fp32 (bf16 rows are widened once per tile for all the item's rows). Scores and p @ c go
// 4 rows at a time, so each vector of a key row loaded serves 4 rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec_cpu.h"

namespace {

using namespace pagedq_vec;

constexpr int64_t kMaxRows = 128;
constexpr int64_t kHeadBlock = 16;
constexpr int64_t kKeyTile = 16;

struct Item {
  int64_t seq, first, num_tokens, head0, num_heads, cost;
};

template <typename Q, typename C>
void run(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& cache,
         const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
         const at::Tensor& block_table, double scale, at::Tensor& out) {
  const int64_t num_seqs = seq_lens.size(0), H = q_latent.size(1);
  const int64_t L = q_latent.size(2), R = q_pe.size(2), W = L + R;
  const int64_t block_size = cache.size(1);
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t bt0 = block_table.stride(0), bt1 = block_table.stride(1);
  const Q* ql = q_latent.data_ptr<Q>();
  const Q* qp = q_pe.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  const C* cp = cache.data_ptr<C>();
  const int64_t c0 = cache.stride(0), c1 = cache.stride(1);
  const int64_t heads_per_item = std::min(H, kHeadBlock);
  const int64_t tokens_per_item = std::max<int64_t>(1, kMaxRows / heads_per_item);

  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    for (int64_t f = 0; f < q_len; f += tokens_per_item) {
      const int64_t nt = std::min(tokens_per_item, q_len - f);
      const int64_t keys = lens[s] - q_len + f + nt;
      for (int64_t h = 0; h < H; h += heads_per_item) {
        const int64_t nh = std::min(heads_per_item, H - h);
        items.push_back({s, f, nt, h, nh, keys * nt * nh});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const float fscale = static_cast<float>(scale);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> qbuf(kMaxRows * W), acc(kMaxRows * L), ktile(kKeyTile * W);
    float m[kMaxRows], l[kMaxRows], alpha[kMaxRows], s[kMaxRows][kKeyTile], p[kMaxRows][kKeyTile];
    int64_t qpos[kMaxRows];
    const float* keys[kKeyTile];
    for (int64_t n = next.fetch_add(1); n < num_items; n = next.fetch_add(1)) {
      const Item& it = items[n];
      const int64_t q_len = starts[it.seq + 1] - starts[it.seq];
      const int64_t context = lens[it.seq] - q_len;
      const int64_t rows = it.num_tokens * it.num_heads;
      const int64_t rows4 = (rows + 3) / 4 * 4;  // padded rows: zero queries that see no key
      for (int64_t r = rows; r < rows4; ++r) {
        std::fill(qbuf.begin() + r * W, qbuf.begin() + (r + 1) * W, 0.f);
        qpos[r] = -1;
        m[r] = kNegInf;
        l[r] = 0.f;
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = starts[it.seq] + it.first + r / it.num_heads;
        const int64_t h = it.head0 + r % it.num_heads;
        const Q* a = ql + t * q_latent.stride(0) + h * q_latent.stride(1);
        const Q* b = qp + t * q_pe.stride(0) + h * q_pe.stride(1);
        float* dst = qbuf.data() + r * W;
        for (int64_t d = 0; d < L; ++d) dst[d] = static_cast<float>(a[d]) * fscale;
        for (int64_t d = 0; d < R; ++d) dst[L + d] = static_cast<float>(b[d]) * fscale;
        qpos[r] = context + it.first + r / it.num_heads;
        m[r] = kNegInf;
        l[r] = 0.f;
      }
      std::fill(acc.begin(), acc.begin() + rows4 * L, 0.f);
      const int64_t key_end = context + it.first + it.num_tokens;
      const int64_t* bt_row = table + it.seq * bt0;
      for (int64_t k0 = 0; k0 < key_end; k0 += kKeyTile) {
        const int64_t nk = std::min(kKeyTile, key_end - k0);
        for (int64_t j = 0; j < nk; ++j) {
          const int64_t pos = k0 + j;
          const C* row = cp + bt_row[(pos / block_size) * bt1] * c0 + (pos % block_size) * c1;
          if constexpr (std::is_same_v<C, float>) {
            keys[j] = row;
          } else {
            float* dst = ktile.data() + j * W;
            for (int64_t d = 0; d < W; ++d) dst[d] = static_cast<float>(row[d]);
            keys[j] = dst;
          }
        }
        // Scores of 4 rows at a time: each key vector load serves 4 rows.
        for (int64_t r0 = 0; r0 < rows4; r0 += 4) {
          const float* q0 = qbuf.data() + r0 * W;
          const float *q1 = q0 + W, *q2 = q1 + W, *q3 = q2 + W;
          for (int64_t j = 0; j < nk; ++j) {
            const float* kp = keys[j];
            vfloat a0 = {}, a1 = {}, a2 = {}, a3 = {};
            int64_t d = 0;
            for (; d + kLanes <= W; d += kLanes) {
              const vfloat kv = loadv(kp + d);
              a0 += loadv(q0 + d) * kv;
              a1 += loadv(q1 + d) * kv;
              a2 += loadv(q2 + d) * kv;
              a3 += loadv(q3 + d) * kv;
            }
            float s0 = sum_lanes(a0), s1 = sum_lanes(a1), s2 = sum_lanes(a2), s3 = sum_lanes(a3);
            for (; d < W; ++d) {
              s0 += q0[d] * kp[d];
              s1 += q1[d] * kp[d];
              s2 += q2[d] * kp[d];
              s3 += q3[d] * kp[d];
            }
            s[r0][j] = s0;
            s[r0 + 1][j] = s1;
            s[r0 + 2][j] = s2;
            s[r0 + 3][j] = s3;
          }
        }
        for (int64_t r = 0; r < rows4; ++r) {
          float mx = m[r];
          for (int64_t j = 0; j < nk; ++j) {
            if (k0 + j > qpos[r]) s[r][j] = kNegInf;  // causal: a later token's key
            mx = std::max(mx, s[r][j]);
          }
          if (mx == kNegInf) {  // no visible key yet for this row
            alpha[r] = 1.f;
            for (int64_t j = 0; j < nk; ++j) p[r][j] = 0.f;
            continue;
          }
          alpha[r] = std::exp(m[r] - mx);  // 0 while m is -inf
          float sum = l[r] * alpha[r];
          for (int64_t j = 0; j < nk; ++j) {
            p[r][j] = std::exp(s[r][j] - mx);
            sum += p[r][j];
          }
          l[r] = sum;
          m[r] = mx;
        }
        // acc = alpha acc + p @ c, 4 rows per key load, a vector of each row's acc in registers.
        for (int64_t r0 = 0; r0 < rows4; r0 += 4) {
          float* a = acc.data() + r0 * L;
          int64_t d = 0;
          for (; d + kLanes <= L; d += kLanes) {
            vfloat a0 = loadv(a + d) * alpha[r0], a1 = loadv(a + L + d) * alpha[r0 + 1];
            vfloat a2 = loadv(a + 2 * L + d) * alpha[r0 + 2];
            vfloat a3 = loadv(a + 3 * L + d) * alpha[r0 + 3];
            for (int64_t j = 0; j < nk; ++j) {
              const vfloat kv = loadv(keys[j] + d);
              a0 += p[r0][j] * kv;
              a1 += p[r0 + 1][j] * kv;
              a2 += p[r0 + 2][j] * kv;
              a3 += p[r0 + 3][j] * kv;
            }
            storev(a + d, a0);
            storev(a + L + d, a1);
            storev(a + 2 * L + d, a2);
            storev(a + 3 * L + d, a3);
          }
          for (; d < L; ++d) {
            for (int64_t i = 0; i < 4; ++i) {
              float x = a[i * L + d] * alpha[r0 + i];
              for (int64_t j = 0; j < nk; ++j) x += p[r0 + i][j] * keys[j][d];
              a[i * L + d] = x;
            }
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = starts[it.seq] + it.first + r / it.num_heads;
        const int64_t h = it.head0 + r % it.num_heads;
        Q* o = op + t * out.stride(0) + h * out.stride(1);
        const float inv = 1.f / l[r];
        const float* a = acc.data() + r * L;
        for (int64_t d = 0; d < L; ++d) o[d] = static_cast<Q>(a[d] * inv);
      }
    }
  });
}

void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong, "mla: ", name, " must be int64");
}

void mla_attention(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& cache,
                   const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                   const at::Tensor& block_table, double scale, at::Tensor& out) {
  TORCH_CHECK(q_latent.dim() == 3 && q_pe.dim() == 3 && q_pe.size(0) == q_latent.size(0) &&
                  q_pe.size(1) == q_latent.size(1) && out.sizes() == q_latent.sizes(),
              "mla_attention: q_latent ", q_latent.sizes(), ", q_pe ", q_pe.sizes(), ", out ",
              out.sizes());
  TORCH_CHECK(q_latent.stride(2) == 1 && q_pe.stride(2) == 1 && out.stride(2) == 1 &&
                  cache.stride(2) == 1,
              "mla_attention: unit stride in the last dim needed");
  TORCH_CHECK(cache.dim() == 3 && cache.size(2) == q_latent.size(2) + q_pe.size(2),
              "mla_attention: latent_cache must be [num_blocks, block_size, L + R], got ",
              cache.sizes());
  TORCH_CHECK(q_latent.scalar_type() == q_pe.scalar_type() &&
                  q_latent.scalar_type() == out.scalar_type(),
              "mla_attention: q_latent, q_pe and out must share a dtype");
  check_index(query_start_loc, "query_start_loc");
  check_index(seq_lens, "seq_lens");
  check_index(block_table, "block_table");
  TORCH_CHECK(query_start_loc.is_contiguous() && seq_lens.is_contiguous() &&
                  query_start_loc.size(0) == seq_lens.size(0) + 1 &&
                  block_table.size(0) >= seq_lens.size(0),
              "mla_attention: query_start_loc [num_seqs + 1], seq_lens and block_table rows");
  const auto qt = q_latent.scalar_type(), ct = cache.scalar_type();
  auto dispatch_cache = [&](auto q_tag) {
    using Q = decltype(q_tag);
    if (ct == at::kFloat) {
      run<Q, float>(q_latent, q_pe, cache, query_start_loc, seq_lens, block_table, scale, out);
    } else if (ct == at::kBFloat16) {
      run<Q, c10::BFloat16>(q_latent, q_pe, cache, query_start_loc, seq_lens, block_table,
                            scale, out);
    } else {
      TORCH_CHECK(false, "mla_attention: the cache must be fp32 or bf16");
    }
  };
  if (qt == at::kFloat) {
    dispatch_cache(float{});
  } else if (qt == at::kBFloat16) {
    dispatch_cache(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, "mla_attention: queries must be fp32 or bf16");
  }
}

template <typename S, typename C>
void write_rows(const at::Tensor& latent, const at::Tensor& k_pe, at::Tensor& cache,
                const int64_t* slots) {
  const int64_t T = latent.size(0), L = latent.size(1), R = k_pe.size(1);
  const int64_t block_size = cache.size(1);
  const S* a = latent.data_ptr<S>();
  const S* b = k_pe.data_ptr<S>();
  C* c = cache.data_ptr<C>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      C* row = c + (slots[t] / block_size) * cache.stride(0) + (slots[t] % block_size) * cache.stride(1);
      const S* x = a + t * latent.stride(0);
      const S* y = b + t * k_pe.stride(0);
      for (int64_t d = 0; d < L; ++d) row[d] = static_cast<C>(static_cast<float>(x[d]));
      for (int64_t d = 0; d < R; ++d) row[L + d] = static_cast<C>(static_cast<float>(y[d]));
    }
  });
}

void write_latent(const at::Tensor& latent, const at::Tensor& k_pe, at::Tensor& cache,
                  const at::Tensor& slot_mapping) {
  TORCH_CHECK(latent.dim() == 2 && k_pe.dim() == 2 && k_pe.size(0) == latent.size(0) &&
                  latent.stride(1) == 1 && k_pe.stride(1) == 1 && cache.stride(2) == 1 &&
                  cache.dim() == 3 && cache.size(2) == latent.size(1) + k_pe.size(1),
              "write_latent: latent ", latent.sizes(), ", k_pe ", k_pe.sizes(), ", cache ",
              cache.sizes());
  TORCH_CHECK(latent.scalar_type() == k_pe.scalar_type(), "write_latent: latent and k_pe dtypes");
  check_index(slot_mapping, "slot_mapping");
  TORCH_CHECK(slot_mapping.is_contiguous() && slot_mapping.size(0) == latent.size(0),
              "write_latent: slot_mapping must hold one slot per token");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t capacity = cache.size(0) * cache.size(1);
  for (int64_t t = 0; t < slot_mapping.size(0); ++t) {
    TORCH_CHECK(slots[t] < capacity, "write_latent: slot ", slots[t], " outside the cache of ",
                capacity);
  }
  const auto st = latent.scalar_type(), ct = cache.scalar_type();
  TORCH_CHECK((st == at::kFloat || st == at::kBFloat16) && (ct == at::kFloat || ct == at::kBFloat16),
              "write_latent: fp32 or bf16 only");
  using BF = c10::BFloat16;
  if (st == at::kFloat && ct == at::kFloat) write_rows<float, float>(latent, k_pe, cache, slots);
  if (st == at::kFloat && ct == at::kBFloat16) write_rows<float, BF>(latent, k_pe, cache, slots);
  if (st == at::kBFloat16 && ct == at::kFloat) write_rows<BF, float>(latent, k_pe, cache, slots);
  if (st == at::kBFloat16 && ct == at::kBFloat16) write_rows<BF, BF>(latent, k_pe, cache, slots);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedq, m) {
  m.def(
      "mla_attention(Tensor q_latent, Tensor q_pe, Tensor latent_cache, Tensor query_start_loc, "
      "Tensor seq_lens, Tensor block_table, float scale, Tensor(a!) out) -> ()");
  m.def("write_latent(Tensor latent, Tensor k_pe, Tensor(a!) latent_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagedq, CPU, m) {
  m.impl("mla_attention", &mla_attention);
  m.impl("write_latent", &write_latent);
}
