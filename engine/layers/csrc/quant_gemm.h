// y = x W^T (+ bias) (+ residual) with W in llama.cpp's block formats (quant_formats.h says
// which, and how their tiles are laid out), computed on the blocks: the weights are never
// dequantized to a float copy.
//
// Why: a GGUF model dequantized at load holds ~6x the bytes of its file and every decode step
// streams them all (SmolLM2's Q4_1 file: 94 MiB on disk, 540 MB of float32). On the blocks a
// step reads the file's bytes, and the multiply-adds run on 8-bit integers: AVX-512 VNNI's
// vpdpbusd does 64 of them per instruction against 16 for a float32 FMA.
//
// Int8 activations (linear_backend "quantized"). Activations are quantized per block of 32 for
// every type, like llama.cpp's Q8_0 (llama.cpp takes 256-wide Q8_K blocks for the K types, and
// rounds ties away from zero; here ties go to even): dx = max|x| / 127,
// qx = round(x * (1 / dx)) in [-127, 127], with sx = sum(qx)
// (and each half's sum, for Q6_K's sub-blocks of 16). A sub-block's dot product is an exact
// integer I = sum(code * qx); the output gains scale * dx * (I - offset * sx) (offset: 8 for
// Q4_0, 128 for Q8_0's stored codes, 32 for Q6_K) and, with a minimum, + m * dx * sx (Q4_1) or
// - (dmin * m_j) * dx * sx (Q4_K, Q5_K), accumulated in float32 over the sub-blocks in order.
// Quantizing activations costs accuracy (`pdserve bench perplexity` measures it).
//
// Float activations ("quantized_float"). Each weight is dequantized in registers exactly as
// gguf dequantizes it at load (quant_formats.h's tile_weight) and every output is one chain of
// fused multiply-adds over k ascending — the blocked float32 kernel's chain (blocked_gemm.h) —
// so the results are the float path's bits, at the file's memory. Slower than int8: 16
// multiply-adds per instruction, and the dequantization on top.
//
// Int8 kernels: AVX-512 VNNI where the CPU has it; else AVX2 (vpmaddubsw + vpmaddwd: the same
// integers, Q8_0's codes taken back to signed bytes whose sign moves onto the activation, as
// llama.cpp does, so no pair sum saturates); else a portable loop. Float activations: AVX-512F
// or the portable loop. All compute the same integers, the same weights and the same chains:
// tests hold every vector kernel to the portable loop, bit for bit.

#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define PDSERVE_QUANT_VNNI 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "quant_formats.h"

namespace pdserve::quant {

// One row's block of 32 activations, quantized.
struct XBlock {
  int8_t q[kQK];
  float d;             // dx
  int32_t s;           // sum(qx)
  int32_t s_lo, s_hi;  // sums of the first and second 16 (Q6_K's sub-blocks)
  float ds;            // dx * sx (the minimum terms)
};

// Block b of row x quantized: dx = max|x| / 127, qx = round(x * (1 / dx)), ties to even.
inline void quantize_block(const float* v, XBlock& o) {
#if defined(__AVX512F__)
  // The same operations as the loop below, 16 lanes at a time: the same bits.
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float d = amax / 127.f;
  const __m512 id = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, id));  // round to nearest even
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, id));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o.q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o.q + 16), _mm512_cvtepi32_epi8(qb));
  o.s_lo = _mm512_reduce_add_epi32(qa);
  o.s_hi = _mm512_reduce_add_epi32(qb);
#else
  float amax = 0.f;
  for (int64_t i = 0; i < kQK; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float d = amax / 127.f;
  const float id = d > 0.f ? 1.f / d : 0.f;
  int32_t half_sums[2] = {0, 0};
  for (int64_t i = 0; i < kQK; ++i) {
    const int32_t q = static_cast<int32_t>(std::nearbyint(v[i] * id));
    o.q[i] = static_cast<int8_t>(q);
    half_sums[i / 16] += q;
  }
  o.s_lo = half_sums[0];
  o.s_hi = half_sums[1];
#endif
  o.d = d;
  o.s = o.s_lo + o.s_hi;
  o.ds = d * static_cast<float>(o.s);
}

// x [rows][k] (row stride x_stride) -> rows * k/32 blocks, rows shared out over the threads
// when there are enough of them to pay for waking them.
inline void quantize_rows(const float* x, int64_t x_stride, int64_t rows, int64_t k, XBlock* out) {
  const int64_t nb = k / kQK;
  const auto some = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < nb; ++b) quantize_block(x + r * x_stride + b * kQK, out[r * nb + b]);
  };
  if (rows < 4) return some(0, rows);
  at::parallel_for(0, rows, 1, some);
}

// One contiguous range of work for the kernels below.
struct Operands {
  const XBlock* x;  // rows * k/32 (int8 activations)
  const float* xf;  // rows of xf_stride (float activations), when x is null
  int64_t xf_stride;
  const uint8_t* w;  // tiles
  int64_t type, nb, n;  // nb: GGUF blocks per row
  const float* bias;      // nullable, [n]
  const float* residual;  // nullable
  int64_t res_stride;
  float* y;
  int64_t y_stride;
};

// Output columns [g*16, g*16+16) of row m from its 16 accumulated values.
inline void store(const Operands& o, int64_t g, int64_t m, const float* acc) {
  float* y = o.y + m * o.y_stride;
  const float* res = o.residual == nullptr ? nullptr : o.residual + m * o.res_stride;
  for (int64_t c = 0; c < kCols && g * kCols + c < o.n; ++c) {
    const int64_t j = g * kCols + c;
    float v = acc[c];
    if (o.bias != nullptr) v += o.bias[j];
    if (res != nullptr) v += res[j];
    y[j] = v;
  }
}

inline const uint8_t* tile_at(const Operands& o, int64_t g, int64_t b) {
  return o.w + (g * o.nb + b) * tile_bytes(o.type);
}

// The portable int8 kernel: tile group g, rows [m0, m1).
inline void group_portable(const Operands& o, int64_t g, int64_t m0, int64_t m1) {
  const int64_t t = o.type, subs = sub_blocks(t);
  const int32_t offset = t == kQ4_0 ? 8 : t == kQ8_0 ? 128 : t == kQ6_K ? 32 : 0;
  for (int64_t m = m0; m < m1; ++m) {
    float acc[kCols] = {};
    for (int64_t b = 0; b < o.nb; ++b) {
      const uint8_t* tile = tile_at(o, g, b);
      for (int64_t j = 0; j < subs; ++j) {
        const XBlock& xb = o.x[m * o.nb * subs + b * subs + j];
        for (int64_t c = 0; c < kCols; ++c) {
          int32_t dot[2] = {0, 0};  // each half's, for Q6_K
          for (int64_t i = 0; i < kQK; ++i)
            dot[i / 16] += tile_code(tile, t, c, j * kQK + i) * xb.q[i];
          if (t == kQ6_K) {
            const float lo = static_cast<float>(dot[0] - offset * xb.s_lo);
            const float hi = static_cast<float>(dot[1] - offset * xb.s_hi);
            acc[c] = std::fma(lo, tile_scale(tile, t, c, 2 * j) * xb.d, acc[c]);
            acc[c] = std::fma(hi, tile_scale(tile, t, c, 2 * j + 1) * xb.d, acc[c]);
            continue;
          }
          const float whole = static_cast<float>(dot[0] + dot[1] - offset * xb.s);
          acc[c] = std::fma(whole, tile_scale(tile, t, c, j) * xb.d, acc[c]);
          if (t == kQ4_1) acc[c] = std::fma(tile_min(tile, t, c, 0), xb.ds, acc[c]);
          if (t == kQ4_K || t == kQ5_K) acc[c] = std::fma(-tile_min(tile, t, c, j), xb.ds, acc[c]);
        }
      }
    }
    store(o, g, m, acc);
  }
}

// The portable kernel with float activations: one fused multiply-add chain per output, k
// ascending, over the weights as gguf dequantizes them.
inline void group_portable_float(const Operands& o, int64_t g, int64_t m0, int64_t m1) {
  const int64_t bw = block_weights(o.type);
  for (int64_t m = m0; m < m1; ++m) {
    const float* x = o.xf + m * o.xf_stride;
    float acc[kCols] = {};
    for (int64_t b = 0; b < o.nb; ++b) {
      const uint8_t* tile = tile_at(o, g, b);
      for (int64_t e = 0; e < bw; ++e)
        for (int64_t c = 0; c < kCols; ++c)
          acc[c] = std::fma(x[b * bw + e], tile_weight(tile, o.type, c, e), acc[c]);
    }
    store(o, g, m, acc);
  }
}

#if defined(__AVX512F__)
// Rows per register tile: 8 accumulators beside the tile's vectors (8 code vectors in the int8
// kernel) within AVX-512's 32 registers.
constexpr int64_t kRows = 8;

// Each row's 16 accumulated outputs of tile group g, through `store`.
template <int64_t R>
inline void store_rows(const Operands& o, int64_t g, int64_t m0, const __m512* acc) {
  for (int64_t r = 0; r < R; ++r) {
    alignas(64) float out[kCols];
    _mm512_store_ps(out, acc[r]);
    store(o, g, m0 + r, out);
  }
}

// Group<T, R>::run(o, g, m0) computes rows [m0, m0 + R) of tile group g: every group in
// [begin, end), rows in register tiles of kRows and one tile of the rest.
template <template <int64_t, int64_t> class Group, int64_t T, int64_t R = kRows>
inline void rows_tail(const Operands& o, int64_t g, int64_t m0, int64_t left) {
  if constexpr (R > 0) {
    if (left == R) return Group<T, R>::run(o, g, m0);
    return rows_tail<Group, T, R - 1>(o, g, m0, left);
  }
}

template <template <int64_t, int64_t> class Group, int64_t T>
inline void tiled(const Operands& o, int64_t rows, int64_t begin, int64_t end) {
  for (int64_t g = begin; g < end; ++g) {
    int64_t m = 0;
    for (; m + kRows <= rows; m += kRows) Group<T, kRows>::run(o, g, m);
    if (m < rows) rows_tail<Group, T>(o, g, m, rows - m);
  }
}

template <template <int64_t, int64_t> class Group>
inline void tiled_by_type(const Operands& o, int64_t rows, int64_t begin, int64_t end) {
  switch (o.type) {
    case kQ4_0: return tiled<Group, kQ4_0>(o, rows, begin, end);
    case kQ4_1: return tiled<Group, kQ4_1>(o, rows, begin, end);
    case kQ8_0: return tiled<Group, kQ8_0>(o, rows, begin, end);
    case kQ4_K: return tiled<Group, kQ4_K>(o, rows, begin, end);
    case kQ5_K: return tiled<Group, kQ5_K>(o, rows, begin, end);
    default: return tiled<Group, kQ6_K>(o, rows, begin, end);
  }
}

// Products and sums rounded one by one, never fused (the float kernel's weights must be the
// gguf package's bits; the module is built with -ffp-contract=fast): instructions with an
// explicit rounding mode are not contracted by any compiler.
constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
inline __m512 mul_rounded(__m512 a, __m512 b) { return _mm512_mul_round_ps(a, b, kNearest); }
inline __m512 add_rounded(__m512 a, __m512 b) { return _mm512_add_round_ps(a, b, kNearest); }
inline __m512 sub_rounded(__m512 a, __m512 b) { return _mm512_sub_round_ps(a, b, kNearest); }

inline __m512 halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 scale bytes (one per column) as floats: unsigned 6-bit (Q4_K, Q5_K) or int8 (Q6_K).
template <bool Signed>
inline __m512 bytes_as_floats(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(Signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
}

// Column scales (d * sc) of 16-weight sub-block j of a tile, as tile_scale computes them.
template <int64_t T>
inline __m512 scales(const uint8_t* tile, int64_t j) {
  const __m512 d = halves(tile);
  if constexpr (T == kQ4_K || T == kQ5_K)
    return mul_rounded(d, bytes_as_floats<false>(tile + kScaleOffset + j * kCols));
  if constexpr (T == kQ6_K)
    return mul_rounded(d, bytes_as_floats<true>(tile + kQ6ScaleOffset + j * kCols));
  return d;
}

// Column minimums of sub-block j (Q4_1's m; the K types' dmin * m_j), as tile_min does.
template <int64_t T>
inline __m512 minimums(const uint8_t* tile, int64_t j) {
  const __m512 m = halves(tile + kMinOffset);
  if constexpr (T == kQ4_K || T == kQ5_K)
    return mul_rounded(m, bytes_as_floats<false>(tile + kSubMinOffset + j * kCols));
  return m;
}

// The codes of quad q (k = 4q .. 4q + 3) of sub-block `codes`: lane c = column c's 4 codes.
template <int64_t T>
inline __m512i quad_codes(const uint8_t* codes, int q) {
  if constexpr (!nibbles(T)) return _mm512_loadu_si512(codes + 64 * q);
  const __m512i v = _mm512_loadu_si512(codes + 64 * (q / 2));  // low nibbles: even quads
  return _mm512_and_si512(q % 2 == 0 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
}

constexpr int32_t code_offset(int64_t t) {
  return t == kQ4_0 ? 8 : t == kQ8_0 ? 128 : t == kQ6_K ? 32 : 0;
}

// R rows of float activations against one tile group: each k's 16 weights are dequantized in
// a vector as tile_weight does (integer code less its offset, to float, times the scale, then
// plus Q4_1's or minus the K types' minimum) and multiply-added into each row's accumulator.
template <int64_t T, int64_t R>
inline void group_float(const Operands& o, int64_t g, int64_t m0) {
  constexpr int64_t bw = block_weights(T);
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i byte = _mm512_set1_epi32(0xFF), offset = _mm512_set1_epi32(code_offset(T));
  for (int64_t b = 0; b < o.nb; ++b) {
    const uint8_t* tile = tile_at(o, g, b);
    for (int64_t j = 0; j < sub_blocks(T); ++j) {
      const uint8_t* codes = tile + header_bytes(T) + j * code_bytes(T);
      const __m512 mins = T == kQ4_1 || T == kQ4_K || T == kQ5_K ? minimums<T>(tile, j)
                                                                 : _mm512_setzero_ps();
      const __m512 scale_lo = scales<T>(tile, T == kQ6_K ? 2 * j : j);
      const __m512 scale_hi = T == kQ6_K ? scales<T>(tile, 2 * j + 1) : scale_lo;
      for (int q = 0; q < 8; ++q) {
        const __m512 scale = q < 4 ? scale_lo : scale_hi;  // Q6_K: sub-blocks of 16
        const __m512i quad = quad_codes<T>(codes, q);
        for (int i = 0; i < 4; ++i) {
          const __m512i code = _mm512_and_si512(_mm512_srli_epi32(quad, 8 * i), byte);
          __m512 w = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_sub_epi32(code, offset)));
          if constexpr (T == kQ4_1) w = _mm512_add_ps(w, mins);
          if constexpr (T == kQ4_K || T == kQ5_K) w = _mm512_sub_ps(w, mins);
          const int64_t k = b * bw + j * kQK + 4 * q + i;
          for (int64_t r = 0; r < R; ++r)
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(o.xf[(m0 + r) * o.xf_stride + k]), w, acc[r]);
        }
      }
    }
  }
  store_rows<R>(o, g, m0, acc);
}

template <int64_t T, int64_t R>
struct FloatGroup {
  static void run(const Operands& o, int64_t g, int64_t m0) { group_float<T, R>(o, g, m0); }
};
#endif

#ifdef PDSERVE_QUANT_VNNI
// R rows against one tile group: each sub-block's 8 code vectors are unpacked once and used by
// each of the R rows (8 vpdpbusd per row and sub-block; Q6_K keeps its two halves apart).
template <int64_t T, int64_t R>
inline void group_vnni(const Operands& o, int64_t g, int64_t m0) {
  constexpr int64_t subs = sub_blocks(T);
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < o.nb; ++b) {
    const uint8_t* tile = tile_at(o, g, b);
    for (int64_t j = 0; j < subs; ++j) {
      const uint8_t* codes = tile + header_bytes(T) + j * code_bytes(T);
      __m512i w[8];
      for (int q = 0; q < 8; ++q) w[q] = quad_codes<T>(codes, q);
      const __m512 scale = scales<T>(tile, T == kQ6_K ? 2 * j : j);
      const __m512 scale_hi = T == kQ6_K ? scales<T>(tile, 2 * j + 1) : scale;
      const __m512 mins = T == kQ4_1 || T == kQ4_K || T == kQ5_K ? minimums<T>(tile, j)
                                                                 : _mm512_setzero_ps();
      for (int64_t r = 0; r < R; ++r) {
        const XBlock& xb = o.x[(m0 + r) * o.nb * subs + b * subs + j];
        const int32_t* xq = reinterpret_cast<const int32_t*>(xb.q);
        const __m512 dx = _mm512_set1_ps(xb.d);
        if constexpr (T == kQ6_K) {
          __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
          for (int q = 0; q < 4; ++q) lo = _mm512_dpbusd_epi32(lo, w[q], _mm512_set1_epi32(xq[q]));
          for (int q = 4; q < 8; ++q) hi = _mm512_dpbusd_epi32(hi, w[q], _mm512_set1_epi32(xq[q]));
          lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(code_offset(T) * xb.s_lo));
          hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(code_offset(T) * xb.s_hi));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(scale, dx), acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(scale_hi, dx), acc[r]);
          continue;
        }
        __m512i dot = _mm512_setzero_si512();
        for (int q = 0; q < 8; ++q) dot = _mm512_dpbusd_epi32(dot, w[q], _mm512_set1_epi32(xq[q]));
        if constexpr (code_offset(T) != 0)
          dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(code_offset(T) * xb.s));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, dx), acc[r]);
        if constexpr (T == kQ4_1) acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(xb.ds), acc[r]);
        if constexpr (T == kQ4_K || T == kQ5_K)
          acc[r] = _mm512_fnmadd_ps(mins, _mm512_set1_ps(xb.ds), acc[r]);
      }
    }
  }
  store_rows<R>(o, g, m0, acc);
}

template <int64_t T, int64_t R>
struct VnniGroup {
  static void run(const Operands& o, int64_t g, int64_t m0) { group_vnni<T, R>(o, g, m0); }
};
#endif

#if defined(__AVX2__)
// Half h (columns 8h .. 8h + 7) of quad q's codes: 8 lanes of 4 unsigned bytes (Q8_0: signed).
template <int64_t T>
inline __m256i avx2_quad(const uint8_t* codes, int q, int h) {
  if constexpr (!nibbles(T)) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * q + 32 * h));
    return T == kQ8_0 ? _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))) : v;
  }
  const __m256i v =
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * (q / 2) + 32 * h));
  return _mm256_and_si256(q % 2 == 0 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
}

// Each lane's sum of 4 code * activation products, as int32.
template <int64_t T>
inline __m256i avx2_dot4(__m256i codes, __m256i x) {
  if constexpr (T == kQ8_0)  // signed codes: |w| times x with w's sign
    return _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_sign_epi8(codes, codes), _mm256_sign_epi8(x, codes)),
        _mm256_set1_epi16(1));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1));
}

inline __m256 avx2_halves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Half h of the column scales (d * sc) of 16-weight sub-block j, as tile_scale computes them.
template <int64_t T>
inline __m256 avx2_scales(const uint8_t* tile, int64_t j, int h) {
  const __m256 d = avx2_halves(tile + 16 * h);
  if constexpr (T == kQ4_K || T == kQ5_K || T == kQ6_K) {
    const int64_t at = (T == kQ6_K ? kQ6ScaleOffset : kScaleOffset) + j * kCols + 8 * h;
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(tile + at));
    const __m256i ints = T == kQ6_K ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(ints));
  }
  return d;
}

template <int64_t T>
inline __m256 avx2_minimums(const uint8_t* tile, int64_t j, int h) {
  const __m256 m = avx2_halves(tile + kMinOffset + 16 * h);
  if constexpr (T == kQ4_K || T == kQ5_K) {
    const __m128i bytes =
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(tile + kSubMinOffset + j * kCols + 8 * h));
    return _mm256_mul_ps(m, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)));
  }
  return m;
}

// One row against one tile group, half h of its columns at a time: the VNNI kernel's
// arithmetic in 8-lane vectors.
template <int64_t T>
inline void row_avx2(const Operands& o, int64_t g, int64_t m) {
  constexpr int64_t subs = sub_blocks(T);
  constexpr int32_t offset = T == kQ8_0 ? 0 : code_offset(T);  // Q8_0: codes made signed
  alignas(32) float out[kCols];
  for (int h = 0; h < 2; ++h) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < o.nb; ++b) {
      const uint8_t* tile = tile_at(o, g, b);
      for (int64_t j = 0; j < subs; ++j) {
        const uint8_t* codes = tile + header_bytes(T) + j * code_bytes(T);
        const XBlock& xb = o.x[m * o.nb * subs + b * subs + j];
        const int32_t* xq = reinterpret_cast<const int32_t*>(xb.q);
        __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
        for (int q = 0; q < 4; ++q)
          lo = _mm256_add_epi32(lo, avx2_dot4<T>(avx2_quad<T>(codes, q, h), _mm256_set1_epi32(xq[q])));
        for (int q = 4; q < 8; ++q)
          hi = _mm256_add_epi32(hi, avx2_dot4<T>(avx2_quad<T>(codes, q, h), _mm256_set1_epi32(xq[q])));
        const __m256 dx = _mm256_set1_ps(xb.d);
        if constexpr (T == kQ6_K) {
          lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(offset * xb.s_lo));
          hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(offset * xb.s_hi));
          acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(avx2_scales<T>(tile, 2 * j, h), dx), acc);
          acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(avx2_scales<T>(tile, 2 * j + 1, h), dx), acc);
          continue;
        }
        __m256i dot = _mm256_add_epi32(lo, hi);
        if constexpr (offset != 0) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(offset * xb.s));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(avx2_scales<T>(tile, j, h), dx), acc);
        if constexpr (T == kQ4_1)
          acc = _mm256_fmadd_ps(avx2_minimums<T>(tile, j, h), _mm256_set1_ps(xb.ds), acc);
        if constexpr (T == kQ4_K || T == kQ5_K)
          acc = _mm256_fnmadd_ps(avx2_minimums<T>(tile, j, h), _mm256_set1_ps(xb.ds), acc);
      }
    }
    _mm256_store_ps(out + 8 * h, acc);
  }
  store(o, g, m, out);
}

template <int64_t T>
inline void groups_avx2(const Operands& o, int64_t rows, int64_t begin, int64_t end) {
  for (int64_t g = begin; g < end; ++g)
    for (int64_t m = 0; m < rows; ++m) row_avx2<T>(o, g, m);
}

inline void avx2_by_type(const Operands& o, int64_t rows, int64_t begin, int64_t end) {
  switch (o.type) {
    case kQ4_0: return groups_avx2<kQ4_0>(o, rows, begin, end);
    case kQ4_1: return groups_avx2<kQ4_1>(o, rows, begin, end);
    case kQ8_0: return groups_avx2<kQ8_0>(o, rows, begin, end);
    case kQ4_K: return groups_avx2<kQ4_K>(o, rows, begin, end);
    case kQ5_K: return groups_avx2<kQ5_K>(o, rows, begin, end);
    default: return groups_avx2<kQ6_K>(o, rows, begin, end);
  }
}
#endif

// Which kernel computes: the best this build has, or one named (tests hold each to portable).
enum class Kernel { kBest, kPortable, kAvx2 };

// The int8 kernels this build has, best first.
inline std::vector<std::string> int8_kernels() {
  std::vector<std::string> names;
#ifdef PDSERVE_QUANT_VNNI
  names.push_back("avx512_vnni");
#endif
#if defined(__AVX2__)
  names.push_back("avx2");
#endif
  names.push_back("portable");
  return names;
}

// Every row against tile groups [begin, end).
inline void groups(const Operands& o, int64_t rows, int64_t begin, int64_t end, Kernel kernel) {
  if (o.x == nullptr) {  // float activations
#if defined(__AVX512F__)
    if (kernel == Kernel::kBest) return tiled_by_type<FloatGroup>(o, rows, begin, end);
#endif
    for (int64_t g = begin; g < end; ++g) group_portable_float(o, g, 0, rows);
    return;
  }
#ifdef PDSERVE_QUANT_VNNI
  if (kernel == Kernel::kBest) return tiled_by_type<VnniGroup>(o, rows, begin, end);
#endif
#if defined(__AVX2__)
  if (kernel != Kernel::kPortable) return avx2_by_type(o, rows, begin, end);
#endif
  for (int64_t g = begin; g < end; ++g) group_portable(o, g, 0, rows);
}

}  // namespace pdserve::quant
