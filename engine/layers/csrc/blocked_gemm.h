// y = x W^T (+ bias) (+ residual), float32, with W stored in column blocks: [N/16][K][16]
// (block b holds output columns 16b..16b+15, k-major; N padded to a multiple of 16 with zeros).
//
// Why this layout: a decode step's linears are matrix-vector products (one row) or thin GEMMs
// (a few dozen rows), bound by reading W once. In blocks, one pass over W is one contiguous
// stream per thread and every loaded W vector is 16 finished dot-product lanes: no horizontal
// sums, no re-packing per call (MKL) and no opaque layout (oneDNN, which reads W at about two
// thirds of this speed at one row). A register tile of R x-rows by 32 W columns (2 blocks)
// keeps 4R accumulators: each W vector feeds R multiply-adds and each broadcast x element 4.
// Measured on the CI machine's 2 cores: at 1 row 25-28 GB/s against oneDNN's 16-20; at 32
// rows on par with oneDNN with 3-row tiles over whole columns; beyond ~64 rows (prefills)
// oneDNN's GEMM is up to 1.5x faster.

#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace pdserve::blocked {

constexpr int64_t kBlock = 16;
constexpr int64_t kLanes = 8;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec load(const float* p) {
  Vec v;
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

// Rows [m0, m0 + R) against blocks [b0, b0 + B), over k in [k0, k1). The accumulators start
// at zero when k0 == 0, else from `part` (this tile's partial sums, R x 2B vectors); they end in
// y (with bias and residual) when k1 == k, else back in `part`. A partial sum stored and
// reloaded is the same float, so every output is summed in the same order (k ascending)
// whatever the chunking: results do not depend on the number of rows.
template <int64_t R, int64_t B>
inline void tile(const Operands& o, int64_t m0, int64_t b0, int64_t k0, int64_t k1, Vec* part) {
  Vec acc[R][2 * B] = {};
  if (k0 > 0) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < 2 * B; ++c) acc[r][c] = part[r * 2 * B + c];
  }
  const float* xs[R];
  for (int64_t r = 0; r < R; ++r) xs[r] = o.x + (m0 + r) * o.x_stride;
  const float* w = o.w + b0 * o.k * kBlock;
  for (int64_t i = k0; i < k1; ++i) {
    Vec wv[2 * B];
    for (int64_t b = 0; b < B; ++b) {
      wv[2 * b] = load(w + (b * o.k + i) * kBlock);
      wv[2 * b + 1] = load(w + (b * o.k + i) * kBlock + kLanes);
    }
    for (int64_t r = 0; r < R; ++r) {
      const Vec xv = Vec{} + xs[r][i];
      for (int64_t c = 0; c < 2 * B; ++c) acc[r][c] += xv * wv[c];
    }
  }
  if (k1 < o.k) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < 2 * B; ++c) part[r * 2 * B + c] = acc[r][c];
    return;
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    float* y = o.y + m * o.y_stride;
    const float* res = o.residual == nullptr ? nullptr : o.residual + m * o.res_stride;
    for (int64_t c = 0; c < 2 * B; ++c) {
      const int64_t j0 = b0 * kBlock + c * kLanes;
      for (int64_t l = 0; l < kLanes && j0 + l < o.n; ++l) {
        float v = acc[r][c][l];
        if (o.bias != nullptr) v += o.bias[j0 + l];
        if (res != nullptr) v += res[j0 + l];
        y[j0 + l] = v;
      }
    }
  }
}

// Row tiles: up to 6 rows x 32 columns (24 accumulators: AVX-512 gives 32 vector registers),
// so each W vector loaded feeds 6 rows; fewer on targets with 16 registers.
#if defined(__AVX512VL__)
constexpr int64_t kTileRows = 6;
#else
constexpr int64_t kTileRows = 3;
#endif

template <int64_t B, int64_t R = kTileRows>
inline void rows_tail(const Operands& o, int64_t m, int64_t left, int64_t b0, int64_t k0,
                      int64_t k1, Vec* part) {
  if constexpr (R > 0) {
    if (left == R) return tile<R, B>(o, m, b0, k0, k1, part);
    return rows_tail<B, R - 1>(o, m, left, b0, k0, k1, part);
  }
}

// Rows [m_begin, m_end) (at most one panel) against blocks [b0, b0 + B). With many rows, k goes
// in chunks: a chunk of W (kChunk x 2B x 16 floats) stays in L1 while every row tile of the
// panel passes over it, instead of streaming the whole column from L2 for each tile.
constexpr int64_t kChunk = 128;
constexpr int64_t kPanel = 64;  // x rows stay in L2 in panels of this many

template <int64_t B>
inline void block_rows(const Operands& o, int64_t m_begin, int64_t m_end, int64_t b0) {
  Vec part[kPanel * 2 * B];
  const int64_t chunk = (m_end - m_begin) > kTileRows ? kChunk : o.k;
  for (int64_t k0 = 0; k0 < o.k; k0 += chunk) {
    const int64_t k1 = std::min(o.k, k0 + chunk);
    int64_t m = m_begin;
    for (; m + kTileRows <= m_end; m += kTileRows)
      tile<kTileRows, B>(o, m, b0, k0, k1, part + (m - m_begin) * 2 * B);
    if (m < m_end)
      rows_tail<B>(o, m, m_end - m, b0, k0, k1, part + (m - m_begin) * 2 * B);
  }
}

inline void run(const Operands& o, int64_t rows) {
  const int64_t blocks = (o.n + kBlock - 1) / kBlock;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  // One contiguous range of blocks per thread: W streams from memory once.
  const int64_t grain = std::max<int64_t>(2, (blocks + threads - 1) / threads);
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = 0; p < rows; p += kPanel) {
      const int64_t p_end = std::min(rows, p + kPanel);
      int64_t b = begin;
      for (; b + 2 <= end; b += 2) block_rows<2>(o, p, p_end, b);
      if (b < end) block_rows<1>(o, p, p_end, b);
    }
  });
}

inline int64_t padded(int64_t n) { return (n + kBlock - 1) / kBlock * kBlock; }

// W [N, K] (nn.Linear's layout) -> [ceil(N/16), K, 16].
inline torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat,
              "weight must be a 2-D float32 tensor");
  const int64_t n = weight.size(0), k = weight.size(1);
  auto w = torch::zeros({padded(n), k}, weight.options());
  w.narrow(0, 0, n).copy_(weight);
  return w.view({padded(n) / kBlock, kBlock, k}).transpose(1, 2).contiguous();
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
  const float* b = nullptr;
  const float* r = nullptr;
  int64_t res_stride = 0;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                    bias->scalar_type() == torch::kFloat,
                "bias must be float32 [out_features]");
    b = bias->data_ptr<float>();
  }
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->size(0) == rows && residual->size(1) == n, "residual must be [M, N]");
    r = residual->data_ptr<float>();
    res_stride = residual->stride(0);
  }
  linear_into(x.data_ptr<float>(), x.stride(0), packed.data_ptr<float>(), n, k, b, r, res_stride,
              y.data_ptr<float>(), n, rows);
  return y;
}

}  // namespace pdserve::blocked
