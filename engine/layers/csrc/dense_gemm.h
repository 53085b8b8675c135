// y = x W^T for a few rows of x, float32, W in nn.Linear's layout ([N, K], row-major).
//
// For the one matrix that must stay row-major: a tied output head is also the embedding table,
// whose rows are looked up by token. (Every other linear is stored in column blocks:
// blocked_gemm.h.) Threads split W's rows into contiguous ranges; 8 W rows at a time are dotted
// with each row of x while they sit in L1 (8 independent accumulator chains keep the loads in
// flight). ~28 GB/s at one row on the 2-core CI machine, against MKL's ~10.

#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace pdserve::dense {

constexpr int64_t kLanes = 8;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
constexpr int64_t kCols = 8;  // W rows per register tile

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// x row `xr` against W rows [j0, j0 + C): C outputs of row y.
template <int64_t C>
inline void tile(const float* xr, const float* w, int64_t k, float* y, int64_t j0) {
  Vec acc[C] = {};
  const int64_t body = k / kLanes * kLanes;
  for (int64_t i = 0; i < body; i += kLanes) {
    const Vec xv = load(xr + i);
    for (int64_t c = 0; c < C; ++c) acc[c] += xv * load(w + (j0 + c) * k + i);
  }
  for (int64_t c = 0; c < C; ++c) {
    float sum = 0.f;
    for (int64_t l = 0; l < kLanes; ++l) sum += acc[c][l];
    for (int64_t i = body; i < k; ++i) sum += xr[i] * w[(j0 + c) * k + i];
    y[j0 + c] = sum;
  }
}

// x [M, K] (rows contiguous), weight [N, K] contiguous.
inline torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "x and weight must be 2-D");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat,
              "float32 only");
  TORCH_CHECK(x.size(1) == weight.size(1), "x and weight disagree on in_features");
  TORCH_CHECK(x.stride(1) == 1 && weight.is_contiguous(), "contiguous rows only");
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  auto y = torch::empty({rows, n}, x.options());
  const float* w = weight.data_ptr<float>();
  const float* xs = x.data_ptr<float>();
  float* out = y.data_ptr<float>();
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t grain = std::max<int64_t>(kCols, (n + threads - 1) / threads);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    // W rows outer, x rows inner: each tile of W is read from memory once for every row.
    int64_t j = begin;
    for (; j + kCols <= end; j += kCols)
      for (int64_t r = 0; r < rows; ++r) tile<kCols>(xs + r * x.stride(0), w, k, out + r * n, j);
    for (; j < end; ++j)
      for (int64_t r = 0; r < rows; ++r) tile<1>(xs + r * x.stride(0), w, k, out + r * n, j);
  });
  return y;
}

}  // namespace pdserve::dense
