// Paged decode attention for CPUs: one query token per request, read straight from the
// block-contiguous KV cache through the block table.
//
// Why a kernel: in plain torch a decode first gathers every context slot into a new
// [B, S, Hkv, D] tensor, then SDPA reads it again; on a CPU both passes are bound by memory
// bandwidth. Here each K and V row is read once, in place, and shared by the G query heads of
// its KV head (GQA), with no padding to the longest context.
//
// Work item = a request (all its heads: each token's K and V rows are read as one contiguous
// run). Two passes over the context: scores (q . k), then softmax and the weighted sum of V.
// Accumulation is in float32 for every dtype.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

struct Geometry {
  int64_t num_kv_heads, group, head_dim, block_size;
  int64_t block_stride, kv_stride, token_stride, head_stride;  // cache strides, in elements
  int64_t q_batch_stride, q_head_stride, table_stride;
};

template <typename T>
inline float dot(const float* __restrict q, const T* __restrict k, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += q[d] * static_cast<float>(k[d]);
  return sum;
}

template <typename T>
inline void axpy(float a, const T* __restrict v, float* __restrict acc, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += a * static_cast<float>(v[d]);
}

// Start pulling the next block's rows of this layer into cache while the current one is read:
// a layer's slice of a block is one short contiguous run, the next one is far away in memory,
// so the hardware prefetcher cannot see it coming.
template <typename T>
inline void prefetch_rows(const T* row, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i);
}

// Calls visit(t, row) for t in [first, len), row = token t's K row (its V row is kv_stride
// further), walking the request's blocks in order. With `prefetch`, the next block's K and V
// rows are requested while the current block is read.
template <typename T, typename Visit>
inline void for_each_token(const Geometry& g, const T* cache, const int64_t* table,
                           int64_t first, int64_t len, bool prefetch, Visit&& visit) {
  const int64_t row_bytes = g.token_stride * static_cast<int64_t>(sizeof(T));
  for (int64_t t0 = first; t0 < len;) {
    const int64_t block = t0 / g.block_size, t1 = std::min(len, (block + 1) * g.block_size);
    const T* base = cache + table[block] * g.block_stride;  // the block's token 0
    const T* ahead = prefetch && t1 < len ? cache + table[block + 1] * g.block_stride : nullptr;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t offset = t - block * g.block_size;
      if (ahead != nullptr) {
        prefetch_rows(ahead + offset * g.token_stride, row_bytes);
        prefetch_rows(ahead + offset * g.token_stride + g.kv_stride, row_bytes);
      }
      visit(t, base + offset * g.token_stride);
    }
    t0 = t1;
  }
}

// Attention of one request over the context [first, len), for the kv heads [h0, h1) and their
// query heads. Tokens are walked in order, each token's K (then V) row read once for all heads.
template <typename T, int64_t kDim>
void attend_one(const Geometry& g, const T* q, const T* cache, const int64_t* table,
                int64_t first, int64_t len, int64_t h0, int64_t h1, float scale, T* out,
                std::vector<float>& scores, std::vector<float>& qf, std::vector<float>& acc) {
  // kDim > 0: the head size is a compile-time constant, so the dot products unroll fully.
  const int64_t D = kDim > 0 ? kDim : g.head_dim;
  const int64_t n = len - first, G = g.group, heads = (h1 - h0) * G;
  scores.resize(static_cast<size_t>(heads * n));
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < D; ++d)
      qf[h * D + d] = static_cast<float>(q[(h0 * G + h) * g.q_head_stride + d]) * scale;

  // Pass over K: scores[h][t] = q_h . k_t (q pre-scaled).
  for_each_token(g, cache, table, first, len, true, [&](int64_t t, const T* row) {
    float* column = &scores[t - first];
    for (int64_t kv = h0; kv < h1; ++kv)
      for (int64_t j = 0; j < G; ++j) {
        const int64_t h = (kv - h0) * G + j;
        column[h * n] = dot(&qf[h * D], row + kv * g.head_stride, D);
      }
  });
  for (int64_t h = 0; h < heads; ++h) {
    float* s = &scores[h * n];
    const float top = *std::max_element(s, s + n);
    float total = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      s[i] = std::exp(s[i] - top);
      total += s[i];
    }
    const float inv = 1.f / total;
    for (int64_t i = 0; i < n; ++i) s[i] *= inv;
  }
  // Pass over V: acc[h] = sum_t p[h][t] * v_t.
  std::fill(acc.begin(), acc.begin() + heads * D, 0.f);
  for_each_token(g, cache, table, first, len, false, [&](int64_t t, const T* row) {
    const float* column = &scores[t - first];
    for (int64_t kv = h0; kv < h1; ++kv)
      for (int64_t j = 0; j < G; ++j) {
        const int64_t h = (kv - h0) * G + j;
        axpy(column[h * n], row + g.kv_stride + kv * g.head_stride, &acc[h * D], D);
      }
  });
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<T>(acc[h * D + d]);
}

template <typename T, int64_t kDim>
void run(const torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& cache,
         const torch::Tensor& block_table, const torch::Tensor& seq_lens, int64_t window,
         double scale) {
  const int64_t batch = query.size(0), num_heads = query.size(1), num_kv_heads = cache.size(3);
  const Geometry g{num_kv_heads,      num_heads / num_kv_heads,
                   query.size(2),     cache.size(2),
                   cache.stride(0),   cache.stride(1),
                   cache.stride(2),   cache.stride(3),
                   query.stride(0),   query.stride(1),
                   block_table.stride(0)};
  const T* q_ptr = query.data_ptr<T>();
  const T* cache_ptr = cache.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t* table_ptr = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  // A work item is a request, or a (request, kv head) pair when there are too few requests
  // to keep every thread busy.
  const int64_t splits = batch < 2 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t heads_per_item = num_kv_heads / splits;
  at::parallel_for(0, batch * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(num_heads * g.head_dim), acc(num_heads * g.head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / splits, h0 = (item % splits) * heads_per_item;
      const int64_t len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      attend_one<T, kDim>(g, q_ptr + b * g.q_batch_stride, cache_ptr, table_ptr + b * g.table_stride,
                    first, len, h0, h0 + heads_per_item, static_cast<float>(scale),
                    out_ptr + (b * num_heads + h0 * g.group) * g.head_dim, scores, qf, acc);
    }
  });
}

// out[B, Hq, D] (contiguous) = attention of query[B, Hq, D] over the paged context.
// cache: one layer's [num_blocks, 2, block_size, Hkv, D] view (each token's heads contiguous);
// block_table: [B, max_blocks] int64; seq_lens: [B] int64, each >= 1; window <= 0: none.
void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor cache,
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
void write_kv(torch::Tensor cache, torch::Tensor key, torch::Tensor value,
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache (CPU)");
  m.def("write_kv", &write_kv, "Write K/V rows into their paged slots (CPU)");
}
