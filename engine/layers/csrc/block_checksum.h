// Checksums of KV cache blocks (connector/checksums.py defines them; this is its CPU kernel):
// checksum(block) = sum_i w_i * x_i mod 2^64 over the block's 32-bit words x_i, with the odd
// 32-bit weights w_i given by the caller. 32 x 32 -> 64-bit products are one instruction per
// 4 (AVX2) or 8 (AVX-512) lanes, and the loop below is plain enough for the compiler to
// vectorise: the sum runs at memory speed, where torch's int64 ops ran ~30x slower.

#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>

namespace pdserve::checksum {

// cache [num_blocks, block_bytes] uint8 (block_bytes a multiple of 4); block_ids int64;
// weights int32 [block_bytes / 4] (their bits are the unsigned weights). Returns int64
// [len(block_ids)] holding the unsigned sums' bits.
inline torch::Tensor block_checksums(const torch::Tensor& cache, const torch::Tensor& block_ids,
                                     const torch::Tensor& weights) {
  TORCH_CHECK(cache.dim() == 2 && cache.scalar_type() == torch::kByte && cache.is_contiguous() &&
                  cache.size(1) % 4 == 0,
              "cache must be contiguous uint8 [num_blocks, block_bytes], block_bytes % 4 == 0");
  TORCH_CHECK(block_ids.dim() == 1 && block_ids.scalar_type() == torch::kLong &&
                  block_ids.is_contiguous(),
              "block_ids must be a contiguous int64 vector");
  const int64_t words = cache.size(1) / 4, num_blocks = cache.size(0), n = block_ids.size(0);
  TORCH_CHECK(weights.dim() == 1 && weights.scalar_type() == torch::kInt &&
                  weights.is_contiguous() && weights.size(0) == words,
              "weights must be int32 [block_bytes / 4]");
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < num_blocks, "block id ", ids[i], " out of range");
  auto out = torch::empty({n}, block_ids.options());
  int64_t* sums = out.data_ptr<int64_t>();
  const auto* base = reinterpret_cast<const uint32_t*>(cache.data_ptr<uint8_t>());
  const auto* w = reinterpret_cast<const uint32_t*>(weights.data_ptr<int32_t>());
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint32_t* x = base + ids[b] * words;
      uint64_t acc = 0;
      for (int64_t i = 0; i < words; ++i) acc += static_cast<uint64_t>(w[i]) * x[i];
      sums[b] = static_cast<int64_t>(acc);
    }
  });
  return out;
}

}  // namespace pdserve::checksum
