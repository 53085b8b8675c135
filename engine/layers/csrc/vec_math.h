// Vectorized float32 math shared by the kernels: e^x over 16 lanes (softmax in paged attention,
// SiLU in the fused decode step). Scalar std::exp stops the compiler from vectorizing a loop
// (each lane becomes a libm call); at 32 decode streams the SiLU alone cost ~6% of a step so.

#pragma once

#include <cstdint>
#include <cstring>

namespace pdserve::vec {

// 16 floats: one AVX-512 register; the compiler splits it on narrower machines.
constexpr int64_t kLanes = 16;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(int32_t))));

// e^x, 16 lanes: 2^k * p(r) with k = round(x / ln2), r = x - k ln2 (|r| <= ln2/2), and a
// degree-6 polynomial (Cephes' expf coefficients; relative error about 2e-7, like libm's).
// x is clamped to [-87, 88], where 2^k stays a normal float: below, ~1e-38 instead of
// denormals and zero; above, ~1.6e38 instead of infinity. NaN stays NaN.
inline Vec exp_approx(Vec x) {
  const Vec lo = Vec{} - 87.0f, hi = Vec{} + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const float kRound = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to nearest
  const Vec k = (x * 1.44269504088896341f + kRound) - kRound;
  const Vec r = x - k * 0.693359375f + k * 2.12194440e-4f;  // ln2 split in two for accuracy
  Vec p = Vec{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const IVec bits = (__builtin_convertvector(k, IVec) + 127) << 23;
  Vec scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline Vec silu_times(Vec g, Vec u) { return g / (1.0f + exp_approx(-g)) * u; }

// a[i] = silu(g[i]) * u[i] = g[i] / (1 + e^-g[i]) * u[i] for i in [0, n).
inline void silu_mul(const float* g, const float* u, float* a, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Vec gv, uv;
    std::memcpy(&gv, g + i, sizeof gv);
    std::memcpy(&uv, u + i, sizeof uv);
    const Vec out = silu_times(gv, uv);
    std::memcpy(a + i, &out, sizeof out);
  }
  if (i < n) {  // the tail through zero-padded vectors: the same arithmetic as the body
    const size_t bytes = static_cast<size_t>(n - i) * sizeof(float);
    Vec gv = {}, uv = {};
    std::memcpy(&gv, g + i, bytes);
    std::memcpy(&uv, u + i, bytes);
    const Vec out = silu_times(gv, uv);
    std::memcpy(a + i, &out, bytes);
  }
}

}  // namespace pdserve::vec
