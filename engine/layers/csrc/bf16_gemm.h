// y = x W^T (+ bias) (+ residual) in bfloat16 (engines with dtype bfloat16 on CPUs), on
// AVX-512 BF16's vdpbf16ps: each 32-bit lane multiplies a pair of bfloat16s by a pair and adds
// both products to a float32 accumulator, 32 multiply-adds per instruction.
//
// Why: torch's bfloat16 linear on a CPU re-packs W for oneDNN on every call, as its float32
// one does (linear.py says what that costs at decode batch sizes). Here W is packed once, in
// column blocks of 16 like blocked_gemm.h's, with consecutive pairs of k side by side:
// [ceil(N/16)][ceil(K/2)][16][2] (K padded with a zero column to an even width). A row of x is
// read as pairs (one 32-bit broadcast per pair); the output is accumulated in float32, the bias
// and residual added in float32, and rounded once to bfloat16 (nearest even), as torch's
// bfloat16 linear rounds its float32 result.

#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define PDSERVE_BF16_KERNEL 1
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "linear_epilogue.h"

namespace pdserve::bf16 {

constexpr int64_t kBlock = 16;

inline bool available() {
#ifdef PDSERVE_BF16_KERNEL
  return true;
#else
  return false;
#endif
}

// W [N, K] bfloat16 -> [ceil(N/16), ceil(K/2), 16, 2], rows past N and the column past K zero.
inline torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16,
              "weight must be a 2-D bfloat16 tensor");
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), pairs = (k + 1) / 2;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  auto packed = torch::zeros({blocks, pairs, kBlock, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t lane = 0; lane < kBlock && b * kBlock + lane < n; ++lane) {
        const uint16_t* row = src + (b * kBlock + lane) * k;
        for (int64_t i = 0; i < k; ++i)
          dst[((b * pairs + i / 2) * kBlock + lane) * 2 + i % 2] = row[i];
      }
  });
  return packed;
}

inline float widen(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &word, 4);
  return f;
}

#ifdef PDSERVE_BF16_KERNEL
struct Operands {
  const uint16_t* x;  // rows of x_stride, K wide (a zero pairs an odd K's last column)
  int64_t x_stride, k;
  const uint16_t* w;  // packed
  const uint16_t* bias;      // nullable
  const uint16_t* residual;  // nullable, rows of res_stride
  int64_t res_stride;
  uint16_t* y;  // rows of y_stride
  int64_t y_stride, n;
};

// Rows [m0, m0 + R) against column block b.
template <int64_t R>
inline void tile(const Operands& o, int64_t m0, int64_t b) {
  const int64_t pairs = (o.k + 1) / 2, full = o.k / 2;
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint16_t* w = o.w + b * pairs * kBlock * 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + p * kBlock * 2);
    for (int64_t r = 0; r < R; ++r) {
      const uint16_t* x = o.x + (m0 + r) * o.x_stride + 2 * p;
      uint32_t pair = x[0];
      if (p < full) pair |= static_cast<uint32_t>(x[1]) << 16;  // else K's zero column
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)), wv);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    alignas(64) float out[kBlock];
    _mm512_store_ps(out, acc[r]);
    const int64_t m = m0 + r;
    for (int64_t c = 0; c < kBlock && b * kBlock + c < o.n; ++c) {
      const int64_t j = b * kBlock + c;
      float v = out[c];
      if (o.bias != nullptr) v += widen(o.bias[j]);
      if (o.residual != nullptr) v += widen(o.residual[m * o.res_stride + j]);
      out[c] = v;
    }
    alignas(32) uint16_t rounded[kBlock];
    _mm256_store_si256(reinterpret_cast<__m256i*>(rounded),
                       (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(out)));
    for (int64_t c = 0; c < kBlock && b * kBlock + c < o.n; ++c)
      o.y[m * o.y_stride + b * kBlock + c] = rounded[c];
  }
}

constexpr int64_t kRows = 8;

template <int64_t R = kRows>
inline void rows_tail(const Operands& o, int64_t m0, int64_t left, int64_t b) {
  if constexpr (R > 0) {
    if (left == R) return tile<R>(o, m0, b);
    return rows_tail<R - 1>(o, m0, left, b);
  }
}
#endif

// x [M, K] bfloat16 (rows contiguous) -> y [M, N] bfloat16.
inline torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                            const c10::optional<torch::Tensor>& bias,
                            const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(available(), "this build has no AVX-512 BF16 kernel");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1,
              "x must be a 2-D bfloat16 tensor with contiguous rows");
  const int64_t rows = x.size(0), k = x.size(1), blocks = (n + kBlock - 1) / kBlock;
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() &&
                  packed.scalar_type() == torch::kBFloat16 && packed.size(0) == blocks &&
                  packed.size(1) == (k + 1) / 2 && packed.size(2) == kBlock && packed.size(3) == 2,
              "packed weight does not match x and out_features");
  auto y = torch::empty({rows, n}, x.options());
#ifdef PDSERVE_BF16_KERNEL
  const auto bits = [](const torch::Tensor& t) {
    return reinterpret_cast<const uint16_t*>(t.data_ptr());
  };
  const Epilogue e = epilogue(bias, residual, rows, n, torch::kBFloat16, "bfloat16");
  const Operands o{bits(x), x.stride(0), k, bits(packed),
                   static_cast<const uint16_t*>(e.bias), static_cast<const uint16_t*>(e.residual),
                   e.res_stride, reinterpret_cast<uint16_t*>(y.data_ptr()), n, n};
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t grain = std::max<int64_t>(1, (blocks + threads - 1) / threads);
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      int64_t m = 0;
      for (; m + kRows <= rows; m += kRows) tile<kRows>(o, m, b);
      if (m < rows) rows_tail(o, m, rows - m, b);
    }
  });
#endif
  return y;
}

}  // namespace pdserve::bf16
