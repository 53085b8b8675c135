// Paged decode attention for CPUs (header of the cpu_ops kernel module, cpu_ops.cpp): one query token per request, read straight from the
// block-contiguous KV cache through the block table.
//
// Why a kernel: in plain torch a decode first gathers every context slot into a new
// [B, S, Hkv, D] tensor, then SDPA reads it again; on a CPU both passes are bound by memory
// bandwidth. Here each K and V row is read once, in place, and shared by the G query heads of
// its KV head (GQA), with no padding to the longest context.
//
// Work item = a request (all its heads: each token's K and V rows are read as one contiguous
// run), handed out longest first to whichever thread is free. Two passes over the context:
// scores (q . k), 16 tokens at a time, then softmax and the weighted sum of V. Accumulation is
// in float32 for every dtype.

#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace pdserve::attention {

using vec::IVec;
using vec::kLanes;
using vec::Vec;

struct Geometry {
  int64_t group, head_dim, block_size;
  int64_t block_stride, kv_stride, token_stride, head_stride;  // cache strides, in elements
  int64_t q_batch_stride, q_head_stride, table_stride;
};

// `count` (<= kLanes) elements from p as floats, the other lanes zero.
template <typename T>
inline Vec load(const T* p, int64_t count = kLanes) {
  Vec v = {};
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&v, p, static_cast<size_t>(count) * sizeof(float));
  } else {
    float tmp[kLanes] = {};
    for (int64_t i = 0; i < count; ++i) tmp[i] = static_cast<float>(p[i]);
    std::memcpy(&v, tmp, sizeof v);
  }
  return v;
}

#if defined(__clang__) || __GNUC__ >= 12
#define PD_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else  // GCC 11 and older (Ubuntu 22.04's default compiler): the older builtin, same lanes
#define PD_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, IVec{__VA_ARGS__})
#endif

// Lane i of the result = the sum of the 16 lanes of v[i]: a transpose-and-add tree, 16 dot
// products finished with 31 shuffles and 15 adds instead of 16 separate horizontal sums.
inline Vec sum_lanes_16(const Vec* v) {
  Vec a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = PD_SHUFFLE(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                      22, 23) +
           PD_SHUFFLE(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                      29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = PD_SHUFFLE(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25,
                      26, 27) +
           PD_SHUFFLE(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29,
                      30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = PD_SHUFFLE(b[2 * i], b[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13,
                      28, 29) +
           PD_SHUFFLE(b[2 * i], b[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15,
                      30, 31);
  const Vec d = PD_SHUFFLE(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
                PD_SHUFFLE(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  // The tree leaves the sums in bit-reversed lane order.
  return PD_SHUFFLE(d, d, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

inline Vec splat(float x) { return Vec{} + x; }

using vec::exp_approx;

// Softmax of s[0, n) in place; s has room for n rounded up to 16, the pad ends as zeros.
inline void softmax_inplace(float* s, int64_t n) {
  const int64_t chunks = (n + kLanes - 1) / kLanes;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::fill(s + n, s + chunks * kLanes, neg_inf);
  Vec top = splat(neg_inf);
  for (int64_t c = 0; c < chunks; ++c) {
    const Vec v = load(s + c * kLanes);
    top = v > top ? v : top;
  }
  float m = top[0];
  for (int64_t i = 1; i < kLanes; ++i) m = std::max(m, top[i]);
  Vec total = {};
  for (int64_t c = 0; c < chunks; ++c) {
    const Vec v = load(s + c * kLanes);
    const Vec e = v == neg_inf ? Vec{} : exp_approx(v - m);
    std::memcpy(s + c * kLanes, &e, sizeof e);
    total += e;
  }
  float sum = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) sum += total[i];
  const Vec inv = splat(1.f / sum);
  for (int64_t c = 0; c < chunks; ++c) {
    const Vec e = load(s + c * kLanes) * inv;
    std::memcpy(s + c * kLanes, &e, sizeof e);
  }
}

template <typename T>
inline void axpy(float a, const T* __restrict v, float* __restrict acc, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += a * static_cast<float>(v[d]);
}

// Rows are requested this many tokens ahead. A block's rows are contiguous but the next block
// is elsewhere, which the hardware prefetcher cannot guess; one tile ahead always covers the
// next block boundary. Into L2, not L1: L2 tracks more misses in flight, and on a cold cache
// (every decode step: the other layers and the weights went through since) the kernel is bound
// by how many misses are outstanding, not by arithmetic (~1.6x faster than prefetching to L1).
constexpr int64_t kPrefetchTokens = kLanes;

inline void prefetch_to_l2(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 2);
}

// Per-thread buffers, reused across work items.
struct Scratch {
  std::vector<const void*> rows;  // token t's K row (all heads); its V row is kv_stride further
  std::vector<float> scores, qf, acc;
  std::vector<Vec> partial;
};

// acc[h] += p[h][t] * v_t for the query heads [m0, m0 + H) of kv head kv, over every token:
// the H x kDim/16 accumulators stay in registers while the tokens stream by (an axpy per token
// and head loaded and stored them each time). Each element is still one chain over t ascending.
template <typename T, int64_t kDim, int64_t H, typename Row>
inline void weigh_heads(const Geometry& g, const Row& row, int64_t n, int64_t n_pad, int64_t kv,
                        int64_t m0, int64_t slice_bytes, Scratch& s) {
  constexpr int64_t C = kDim / kLanes;
  Vec acc[H][C] = {};
  const float* p = &s.scores[(kv * g.group + m0) * n_pad];
  for (int64_t i = 0; i < n; ++i) {
    if (kv == 0 && m0 == 0 && i + kPrefetchTokens < n)
      prefetch_to_l2(row(i + kPrefetchTokens) + g.kv_stride, slice_bytes);
    const T* v = row(i) + g.kv_stride + kv * g.head_stride;
    Vec vv[C];
    for (int64_t c = 0; c < C; ++c) vv[c] = load(v + c * kLanes, kLanes);  // not c10::load
    for (int64_t h = 0; h < H; ++h) {
      const Vec ph = splat(p[h * n_pad + i]);
      for (int64_t c = 0; c < C; ++c) acc[h][c] += ph * vv[c];
    }
  }
  for (int64_t h = 0; h < H; ++h)
    std::memcpy(&s.acc[(kv * g.group + m0 + h) * kDim], acc[h], sizeof acc[h]);
}

// The group's last `left` (< H) query heads in one pass.
template <typename T, int64_t kDim, int64_t H, typename Row>
inline void weigh_rest(const Geometry& g, const Row& row, int64_t n, int64_t n_pad, int64_t kv,
                       int64_t m0, int64_t left, int64_t slice_bytes, Scratch& s) {
  if constexpr (H > 0) {
    if (left == H) return weigh_heads<T, kDim, H>(g, row, n, n_pad, kv, m0, slice_bytes, s);
    return weigh_rest<T, kDim, H - 1>(g, row, n, n_pad, kv, m0, left, slice_bytes, s);
  }
}

// The pass over V for every kv head of the work item, its query heads H at a time (as many as
// keep 16 accumulators: 4 heads of 64, 2 of 128), then the rest of the group in one pass.
template <typename T, int64_t kDim, typename Row>
inline void weigh_values(const Geometry& g, const Row& row, int64_t n, int64_t n_pad,
                         int64_t kv_heads, int64_t slice_bytes, Scratch& s) {
  static_assert(kDim % kLanes == 0, "compile-time head sizes are whole vectors");
  constexpr int64_t H = std::max<int64_t>(1, 16 / (kDim / kLanes));
  for (int64_t kv = 0; kv < kv_heads; ++kv) {
    int64_t m = 0;
    for (; m + H <= g.group; m += H) weigh_heads<T, kDim, H>(g, row, n, n_pad, kv, m, slice_bytes, s);
    if (m < g.group)
      weigh_rest<T, kDim, H - 1>(g, row, n, n_pad, kv, m, g.group - m, slice_bytes, s);
  }
}

// Attention of one request over the context [first, len), for the kv heads [h0, h1) and their
// query heads.
template <typename T, int64_t kDim>
void attend_one(const Geometry& g, const T* q, const T* cache, const int64_t* table,
                int64_t first, int64_t len, int64_t h0, int64_t h1, float scale, T* out,
                Scratch& s) {
  // kDim > 0: the head size is a compile-time constant, so the chunk loops unroll fully.
  const int64_t D = kDim > 0 ? kDim : g.head_dim;
  const int64_t chunks = (D + kLanes - 1) / kLanes, tail = D - (chunks - 1) * kLanes;
  const int64_t n = len - first, n_pad = (n + kLanes - 1) / kLanes * kLanes;
  const int64_t G = g.group, heads = (h1 - h0) * G, q_width = chunks * kLanes;
  s.rows.resize(static_cast<size_t>(n));
  s.scores.resize(static_cast<size_t>(heads * n_pad));
  s.qf.assign(static_cast<size_t>(heads * q_width), 0.f);  // zero past D: the tail lanes
  s.acc.assign(static_cast<size_t>(heads * D), 0.f);
  s.partial.resize(static_cast<size_t>(heads * kLanes));
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < D; ++d)
      s.qf[h * q_width + d] = static_cast<float>(q[(h0 * G + h) * g.q_head_stride + d]) * scale;
  for (int64_t t = first, b = first / g.block_size; t < len; ++b) {
    const T* base = cache + table[b] * g.block_stride;
    for (int64_t o = t - b * g.block_size; o < g.block_size && t < len; ++o, ++t)
      s.rows[t - first] = base + o * g.token_stride;
  }
  const auto row = [&](int64_t i) { return static_cast<const T*>(s.rows[i]) + h0 * g.head_stride; };
  const int64_t slice_bytes = (h1 - h0) * g.head_stride * static_cast<int64_t>(sizeof(T));

  // Pass over K, 16 tokens at a time: partial[h][j] holds q_h * k_j lane-wise, then one tree
  // turns the 16 vectors into 16 scores.
  for (int64_t i0 = 0; i0 < n; i0 += kLanes) {
    const int64_t count = std::min(kLanes, n - i0);
    for (int64_t j = 0; j < count; ++j) {
      if (i0 + j + kPrefetchTokens < n) prefetch_to_l2(row(i0 + j + kPrefetchTokens), slice_bytes);
      const T* k_row = row(i0 + j);
      for (int64_t kv = 0; kv < h1 - h0; ++kv) {
        const T* k = k_row + kv * g.head_stride;
        for (int64_t m = 0; m < G; ++m) {
          const int64_t h = kv * G + m;
          const float* qh = &s.qf[h * q_width];
          Vec sum = {};
          for (int64_t c = 0; c < chunks; ++c) {
            Vec qc;
            std::memcpy(&qc, qh + c * kLanes, sizeof qc);
            sum += qc * load(k + c * kLanes, c + 1 < chunks ? kLanes : tail);
          }
          s.partial[h * kLanes + j] = sum;
        }
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      Vec* p = &s.partial[h * kLanes];
      for (int64_t j = count; j < kLanes; ++j) p[j] = Vec{};
      const Vec sums = sum_lanes_16(p);
      std::memcpy(&s.scores[h * n_pad + i0], &sums, sizeof sums);
    }
  }
  for (int64_t h = 0; h < heads; ++h) softmax_inplace(&s.scores[h * n_pad], n);

  // Pass over V: acc[h] = sum_t p[h][t] * v_t, each element summed over t ascending.
  if constexpr (kDim > 0) {
    weigh_values<T, kDim>(g, row, n, n_pad, h1 - h0, slice_bytes, s);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const T* v_row = row(i) + g.kv_stride;
      if (i + kPrefetchTokens < n)
        prefetch_to_l2(row(i + kPrefetchTokens) + g.kv_stride, slice_bytes);
      for (int64_t kv = 0; kv < h1 - h0; ++kv)
        for (int64_t m = 0; m < G; ++m) {
          const int64_t h = kv * G + m;
          axpy(s.scores[h * n_pad + i], v_row + kv * g.head_stride, &s.acc[h * D], D);
        }
    }
  }
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<T>(s.acc[h * D + d]);
}

template <typename T, int64_t kDim>
void run(const torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& cache,
         const torch::Tensor& block_table, const torch::Tensor& seq_lens, int64_t window,
         double scale) {
  const int64_t batch = query.size(0), num_heads = query.size(1), num_kv_heads = cache.size(3);
  const Geometry g{num_heads / num_kv_heads, query.size(2),   cache.size(2),
                   cache.stride(0),          cache.stride(1), cache.stride(2),
                   cache.stride(3),          query.stride(0), query.stride(1),
                   block_table.stride(0)};
  const T* q_ptr = query.data_ptr<T>();
  const T* cache_ptr = cache.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t* table_ptr = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const auto context = [&](int64_t b) {
    return window > 0 ? std::min(lens[b], window) : lens[b];
  };
  // A work item is a request, or a (request, kv head) pair when there are too few requests
  // to keep every thread busy. Longest first, each thread taking the next free item: static
  // ranges would leave one thread idle while another works through the long contexts.
  const int64_t threads = at::get_num_threads();
  const int64_t splits = batch < 2 * threads ? num_kv_heads : 1;
  const int64_t heads_per_item = num_kv_heads / splits;
  std::vector<int64_t> order(static_cast<size_t>(batch));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return context(x) > context(y); });
  std::atomic<int64_t> next{0};
  const int64_t items = batch * splits;
  at::parallel_for(0, std::min(threads, items), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t item = next++; item < items; item = next++) {
      const int64_t b = order[item / splits], h0 = (item % splits) * heads_per_item;
      const int64_t len = lens[b], first = len - context(b);
      attend_one<T, kDim>(g, q_ptr + b * g.q_batch_stride, cache_ptr,
                          table_ptr + b * g.table_stride, first, len, h0, h0 + heads_per_item,
                          static_cast<float>(scale),
                          out_ptr + (b * num_heads + h0 * g.group) * g.head_dim, scratch);
    }
  });
}

// out[B, Hq, D] (contiguous) = attention of query[B, Hq, D] over the paged context.
// cache: one layer's [num_blocks, 2, block_size, Hkv, D] view (each token's heads contiguous);
// block_table: [B, max_blocks] int64; seq_lens: [B] int64, each >= 1; window <= 0: none.
inline void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor cache,
                            torch::Tensor block_table, torch::Tensor seq_lens, int64_t window,
                            double scale) {
  TORCH_CHECK(query.dim() == 3 && cache.dim() == 5, "query [B,Hq,D], cache [N,2,bs,Hkv,D]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes(), "out must match query");
  TORCH_CHECK(query.stride(2) == 1 && cache.stride(4) == 1, "head_dim must be contiguous");
  TORCH_CHECK(cache.stride(3) == cache.size(4), "a token's heads must be contiguous");
  TORCH_CHECK(query.size(1) % cache.size(3) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(query.scalar_type() == cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "query, cache and out must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && block_table.stride(1) == 1 &&
                  seq_lens.scalar_type() == torch::kInt64 && seq_lens.is_contiguous(),
              "block_table and seq_lens must be int64 with contiguous rows");
  TORCH_CHECK(block_table.size(0) == query.size(0) && seq_lens.size(0) == query.size(0),
              "one block-table row and one seq_len per query");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    switch (query.size(2)) {
      case 32:
        return run<scalar_t, 32>(out, query, cache, block_table, seq_lens, window, scale);
      case 64:
        return run<scalar_t, 64>(out, query, cache, block_table, seq_lens, window, scale);
      case 128:
        return run<scalar_t, 128>(out, query, cache, block_table, seq_lens, window, scale);
      default:
        return run<scalar_t, 0>(out, query, cache, block_table, seq_lens, window, scale);
    }
  });
}

// Scatter this step's K and V ([T, Hkv, D], each token's heads contiguous) into their slots:
// one memcpy per token and side instead of two advanced-indexing writes per layer.
inline void write_kv(torch::Tensor cache, torch::Tensor key, torch::Tensor value,
              torch::Tensor slot_block, torch::Tensor slot_offset) {
  TORCH_CHECK(cache.dim() == 5 && key.dim() == 3 && value.dim() == 3, "cache, key, value ranks");
  TORCH_CHECK(key.scalar_type() == cache.scalar_type() && value.scalar_type() == cache.scalar_type(),
              "key, value and cache must share a dtype");
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(1) == cache.size(3) &&
                  key.size(2) == cache.size(4),
              "key and value must be [T, Hkv, D] of the cache's heads");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2) && cache.stride(4) == 1 &&
                  cache.stride(3) == cache.size(4),
              "each token's heads must be contiguous");
  TORCH_CHECK(slot_block.scalar_type() == torch::kInt64 && slot_offset.scalar_type() == torch::kInt64 &&
                  slot_block.is_contiguous() && slot_offset.is_contiguous() &&
                  slot_block.numel() == key.size(0) && slot_offset.numel() == key.size(0),
              "one int64 slot (block, offset) per token");
  const int64_t elem = key.element_size();
  const int64_t tokens = key.size(0), bytes = key.size(1) * key.size(2) * elem;
  const int64_t block_stride = cache.stride(0), kv_stride = cache.stride(1);
  const int64_t token_stride = cache.stride(2), num_blocks = cache.size(0);
  const int64_t block_size = cache.size(2);
  const int64_t* blocks = slot_block.data_ptr<int64_t>();
  const int64_t* offsets = slot_offset.data_ptr<int64_t>();
  char* base = static_cast<char*>(cache.data_ptr());
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  for (int64_t i = 0; i < tokens; ++i) {
    TORCH_CHECK(blocks[i] >= 0 && blocks[i] < num_blocks && offsets[i] >= 0 &&
                    offsets[i] < block_size,
                "slot out of range");
    char* row = base + (blocks[i] * block_stride + offsets[i] * token_stride) * elem;
    std::memcpy(row, k + i * key.stride(0) * elem, bytes);
    std::memcpy(row + kv_stride * elem, v + i * value.stride(0) * elem, bytes);
  }
}

}  // namespace pdserve::attention
