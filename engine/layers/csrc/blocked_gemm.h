// y = x W^T (+ bias) (+ residual), float32, with W stored in column blocks: [N/16][K][16]
// (block b holds output columns 16b..16b+15, k-major; N padded to a multiple of 16 with zeros).
//
// Why this layout: a decode step's linears are matrix-vector products (one row) or thin GEMMs
// (a few dozen rows), bound by reading W once. In blocks, one pass over W is one contiguous
// stream per thread and every loaded W vector is 16 finished dot-product lanes: no horizontal
// sums, no re-packing per call (MKL) and no opaque layout (oneDNN, which reads W at about two
// thirds of this speed at one row). Register tiles of x rows by W blocks (see Narrow and Wide
// below) reuse each loaded W vector for every row of the tile.
// Measured on the CI machine's 2 cores: at 1 row 25-28 GB/s against oneDNN's 16-20; at 32 rows
// 175-200 GFLOP/s (75-86% of the FMA peak; oneDNN ~150); beyond ~64 rows (prefills) oneDNN's
// GEMM is up to 1.4x faster.

#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "linear_epilogue.h"

namespace pdserve::blocked {

constexpr int64_t kBlock = 16;

// A vector of L floats (8: one AVX2 register; 16: one AVX-512 register).
template <int64_t L>
struct VecOf {
  typedef float type __attribute__((vector_size(L * sizeof(float))));
};

template <int64_t L>
inline typename VecOf<L>::type load(const float* p) {
  typename VecOf<L>::type v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

struct Operands {
  const float* x;
  int64_t x_stride;
  const float* w;  // [blocks][k][16]
  const float* bias;      // nullable, [n]
  const float* residual;  // nullable, rows of res_stride
  int64_t res_stride;
  float* y;  // rows of y_stride
  int64_t y_stride, k, n;
};

// Rows [m0, m0 + R) against blocks [b0, b0 + B), over k in [k0, k1), in vectors of L lanes. The
// accumulators start at zero when k0 == 0, else from `part` (this tile's partial sums, R x 16B
// floats); they end in y (with bias and residual) when k1 == k, else back in `part`. Every
// output is one chain of fused multiply-adds over k ascending: a partial sum stored and
// reloaded is the same float, and the lane width only decides how many outputs one instruction
// advances. So no tile shape, chunking or row count changes a result: a row's output never
// depends on its batch.
template <int64_t L, int64_t R, int64_t B>
inline void tile(const Operands& o, int64_t m0, int64_t b0, int64_t k0, int64_t k1, float* part) {
  using Vec = typename VecOf<L>::type;
  constexpr int64_t C = B * kBlock / L;  // accumulators per row
  Vec acc[R][C] = {};
  if (k0 > 0) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) acc[r][c] = load<L>(part + (r * C + c) * L);
  }
  const float* xs[R];
  for (int64_t r = 0; r < R; ++r) xs[r] = o.x + (m0 + r) * o.x_stride;
  const float* w = o.w + b0 * o.k * kBlock;
  for (int64_t i = k0; i < k1; ++i) {
    Vec wv[C];
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < kBlock / L; ++h)
        wv[b * (kBlock / L) + h] = load<L>(w + (b * o.k + i) * kBlock + h * L);
    for (int64_t r = 0; r < R; ++r) {
      const Vec xv = Vec{} + xs[r][i];
      for (int64_t c = 0; c < C; ++c) acc[r][c] += xv * wv[c];
    }
  }
  if (k1 < o.k) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) std::memcpy(part + (r * C + c) * L, &acc[r][c], sizeof(Vec));
    return;
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    float* y = o.y + m * o.y_stride;
    const float* res = o.residual == nullptr ? nullptr : o.residual + m * o.res_stride;
    for (int64_t c = 0; c < C; ++c) {
      const int64_t j0 = b0 * kBlock + c * L;
      if (j0 + L <= o.n) {  // whole vectors: the same adds, in the same order, as below
        Vec v = acc[r][c];
        if (o.bias != nullptr) v += load<L>(o.bias + j0);
        if (res != nullptr) v += load<L>(res + j0);
        std::memcpy(y + j0, &v, sizeof v);
        continue;
      }
      for (int64_t l = 0; l < L && j0 + l < o.n; ++l) {
        float v = acc[r][c][l];
        if (o.bias != nullptr) v += o.bias[j0 + l];
        if (res != nullptr) v += res[j0 + l];
        y[j0 + l] = v;
      }
    }
  }
}

// Two tile shapes. Few rows (a single stream, small batches) are bound by reading W: with
// AVX-512, 8-lane vectors over 4 blocks give 8 independent accumulator chains per row, enough
// to keep loads in flight (one row over 30 layers' linears: 25.5-27.5 GB/s with 2 blocks,
// 27.6-28 with 4, stream_sum 28-35), in tiles of up to 3 rows; 2 blocks where only 16 vector
// registers exist. Many rows are bound by multiply-adds: with AVX-512, 8 rows x 3 blocks of 16 lanes keep 24 accumulators in
// registers, and each k step issues 24 FMAs for 3 W loads and 8 broadcasts (the 6 x 2-block
// 8-lane tile issued 24 half-width FMAs for 10 loads). Measured on the CI machine's Zen 4 core:
// 32-row linears ~78% of the FMA peak with the narrow tiles, ~93-99% with the wide ones.
struct Narrow {
  static constexpr int64_t kLanes = 8, kRows = 3;
#if defined(__AVX512F__)
  static constexpr int64_t kBlocks = 4;
#else
  static constexpr int64_t kBlocks = 2;
#endif
};
struct Wide {
  static constexpr int64_t kLanes = 16, kBlocks = 3, kRows = 8;
};
#if defined(__AVX512F__)
constexpr int64_t kWideFrom = Wide::kRows;  // rows at which the wide tiles take over
#else
constexpr int64_t kWideFrom = INT64_MAX;  // 16-lane vectors would be split in two: no gain
#endif

template <typename S, int64_t B, int64_t R = S::kRows>
inline void rows_tail(const Operands& o, int64_t m, int64_t left, int64_t b0, int64_t k0,
                      int64_t k1, float* part) {
  if constexpr (R > 0) {
    if (left == R) return tile<S::kLanes, R, B>(o, m, b0, k0, k1, part);
    return rows_tail<S, B, R - 1>(o, m, left, b0, k0, k1, part);
  }
}

constexpr int64_t kPanel = 64;  // x rows stay in L2 in panels of this many
// With narrow tiles over many rows, k goes in chunks: a chunk of W (kChunk x the tile's blocks)
// stays in L1 while every row tile of the panel passes over it. The wide tiles reuse each W
// vector 8 times in registers and stream whole columns (chunking them measured slower).
constexpr int64_t kChunk = 128;

// Rows [m_begin, m_end) (at most one panel) against blocks [b0, b0 + B).
template <typename S, int64_t B>
inline void block_rows(const Operands& o, int64_t m_begin, int64_t m_end, int64_t b0) {
  float part[kPanel * B * kBlock];
  const bool chunked = std::is_same_v<S, Narrow> && (m_end - m_begin) > S::kRows;
  const int64_t chunk = chunked ? kChunk : o.k;
  for (int64_t k0 = 0; k0 < o.k; k0 += chunk) {
    const int64_t k1 = std::min(o.k, k0 + chunk);
    int64_t m = m_begin;
    for (; m + S::kRows <= m_end; m += S::kRows)
      tile<S::kLanes, S::kRows, B>(o, m, b0, k0, k1, part + (m - m_begin) * B * kBlock);
    if (m < m_end)
      rows_tail<S, B>(o, m, m_end - m, b0, k0, k1, part + (m - m_begin) * B * kBlock);
  }
}

// Blocks [begin, end) for every row, B blocks at a time (fewer at the end of the range).
template <typename S, int64_t B = S::kBlocks>
inline void column_range(const Operands& o, int64_t rows, int64_t begin, int64_t end) {
  if constexpr (B > 0) {
    int64_t b = begin;
    for (; b + B <= end; b += B)
      for (int64_t p = 0; p < rows; p += kPanel) block_rows<S, B>(o, p, std::min(rows, p + kPanel), b);
    column_range<S, B - 1>(o, rows, b, end);
  }
}

inline void run(const Operands& o, int64_t rows) {
  const int64_t blocks = (o.n + kBlock - 1) / kBlock;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  // One contiguous range of blocks per thread: W streams from memory once.
  const int64_t grain = std::max<int64_t>(2, (blocks + threads - 1) / threads);
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    if (rows >= kWideFrom)
      column_range<Wide>(o, rows, begin, end);
    else
      column_range<Narrow>(o, rows, begin, end);
  });
}

inline int64_t padded(int64_t n) { return (n + kBlock - 1) / kBlock * kBlock; }

// W [N, K] (nn.Linear's layout) -> [ceil(N/16), K, 16], rows past N zero. One pass, blocks
// shared out over the threads: each block reads its 16 rows in order and writes K * 64 bytes
// that stay in cache. (torch's transposed copy, what this replaced, took ~10x longer: a model
// load spent more time packing than reading and dequantizing its file.)
inline torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat,
              "weight must be a 2-D float32 tensor");
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), blocks = padded(n) / kBlock;
  auto packed = torch::empty({blocks, k, kBlock}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      float* out = dst + b * k * kBlock;
      for (int64_t lane = 0; lane < kBlock; ++lane) {
        const int64_t row = b * kBlock + lane;
        if (row < n) {
          const float* in = src + row * k;
          for (int64_t i = 0; i < k; ++i) out[i * kBlock + lane] = in[i];
        } else {
          for (int64_t i = 0; i < k; ++i) out[i * kBlock + lane] = 0.0f;
        }
      }
    }
  });
  return packed;
}

// Raw entry for the fused decode step (shapes checked by the caller). y may be the residual.
inline void linear_into(const float* x, int64_t x_stride, const float* w, int64_t n, int64_t k,
                        const float* bias, const float* residual, int64_t res_stride, float* y,
                        int64_t y_stride, int64_t rows) {
  const Operands o{x, x_stride, w, bias, residual, res_stride, y, y_stride, k, n};
  if (rows > 0 && n > 0) run(o, rows);
}

inline void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kFloat && t.stride(1) == 1, name,
              " must be a 2-D float32 tensor with contiguous rows");
}

// x [M, K] (rows contiguous); packed from pack(); n = out_features; bias [n] or None;
// residual [M, n] or None (added after the bias).
inline torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                            const c10::optional<torch::Tensor>& bias,
                            const c10::optional<torch::Tensor>& residual) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == torch::kFloat &&
                  packed.size(1) == k && packed.size(2) == kBlock && packed.size(0) * kBlock >= n &&
                  padded(n) == packed.size(0) * kBlock,
              "packed weight does not match x and out_features");
  auto y = torch::empty({rows, n}, x.options());
  const Epilogue e = epilogue(bias, residual, rows, n, torch::kFloat, "float32");
  linear_into(x.data_ptr<float>(), x.stride(0), packed.data_ptr<float>(), n, k,
              static_cast<const float*>(e.bias), static_cast<const float*>(e.residual),
              e.res_stride, y.data_ptr<float>(), n, rows);
  return y;
}

}  // namespace pdserve::blocked
