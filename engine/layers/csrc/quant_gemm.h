// y = x W^T (+ bias) (+ residual) with W in llama.cpp's block formats Q4_0, Q4_1 and Q8_0,
// computed on the blocks: the weights are never dequantized to floats.
//
// Why: a GGUF model dequantized at load holds ~6x the bytes of its file and every decode step
// streams them all (SmolLM2's Q4_1 file: 94 MiB on disk, 540 MB of float32). On the blocks a
// step reads the file's bytes, and the multiply-adds run on 8-bit integers: AVX-512 VNNI's
// vpdpbusd does 64 of them per instruction against 16 for a float32 FMA.
//
// Numbers. A block is 32 consecutive weights of a row sharing a float16 scale d (and, in Q4_1, a
// float16 minimum m): w = d * (q - 8) for Q4_0, d * q + m for Q4_1, d * q for Q8_0. Activations
// are quantized as llama.cpp does, per block of 32: dx = max|x| / 127, qx = round(x / dx) in
// [-127, 127], with sx = sum(qx). A block's dot product is then an exact integer
// I = sum(q * qx) and the output gains d * dx * (I - 8 sx) (Q4_0), d * dx * I + m * dx * sx
// (Q4_1) or d * dx * I (Q8_0), accumulated in float32 over the blocks in order. Quantizing the
// activations costs accuracy (measured by `pdserve bench perplexity`); the float32 path
// (linear_backend "blocked") stays the oracle.
//
// Layout ("tiles"). The bits of every block are kept, rearranged once at load so that one
// 512-bit vector holds 16 output columns: W [N, K] becomes [ceil(N/16)][K/32] tiles, each the 16
// columns' scales (float16 x 16), their minimums (Q4_1) and their quants, interleaved by groups
// of 4 consecutive k so that each 32-bit lane of a vector is one column's next 4 weights — the
// operand vpdpbusd multiplies with 4 activations broadcast to every lane. Q4 tiles hold nibbles:
// byte i of lane c of chunk j (j < 4) is q[c][8j + i] | q[c][8j + 4 + i] << 4. Q8 tiles hold
// q + 128 as unsigned bytes (vpdpbusd multiplies unsigned by signed), corrected by - 128 sx.
// The tiles take exactly the bytes of the blocks (Q4_1: 16 x 20 bytes per 16 x 32 weights).
// Tail columns (N not a multiple of 16) are zero tiles: scale 0.
//
// Float activations ("quantized_float"). The same tiles can instead be multiplied by float32
// activations: each weight is dequantized in registers exactly as gguf dequantizes it at load
// (d * (q - 8), d * q + m, d * q: float32, never fused) and every output is one chain of fused
// multiply-adds over k ascending — the blocked float32 kernel's chain (blocked_gemm.h) — so the
// results are the float path's bits, at the file's memory. Slower than int8: 16 multiply-adds
// per instruction, and the dequantization on top.
//
// Without AVX-512 VNNI (or AVX-512F, for float activations) a portable loop computes the same
// integers, the same weights and the same chains; it is also what tests hold the vector kernels
// to.

#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define PDSERVE_QUANT_VNNI 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace pdserve::quant {

// GGML's type ids: what the GGUF file says of each tensor.
enum Type : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

constexpr int64_t kCols = 16;  // output columns per tile
constexpr int64_t kQK = 32;    // weights per block

inline bool known(int64_t type) { return type == kQ4_0 || type == kQ4_1 || type == kQ8_0; }

// Bytes of one GGUF block, and of one tile (kCols blocks, rearranged).
inline int64_t block_bytes(int64_t type) {
  return type == kQ4_0 ? 18 : type == kQ4_1 ? 20 : 34;
}
inline int64_t tile_bytes(int64_t type) { return kCols * block_bytes(type); }
inline int64_t scale_bytes(int64_t type) { return (type == kQ4_1 ? 2 : 1) * kCols * 2; }

inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// One row's block of activations, quantized.
struct XBlock {
  int8_t q[kQK];
  float d;    // dx
  int32_t s;  // sum(qx)
  float ds;   // dx * sx (Q4_1's minimum term)
};

// x [rows][k] (row stride x_stride) -> rows * k/32 blocks.
inline void quantize_rows(const float* x, int64_t x_stride, int64_t rows, int64_t k, XBlock* out) {
  const int64_t nb = k / kQK;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + r * x_stride + b * kQK;
      XBlock& o = out[r * nb + b];
      float amax = 0.f;
      for (int64_t i = 0; i < kQK; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float d = amax / 127.f;
      const float id = d > 0.f ? 1.f / d : 0.f;
      int32_t s = 0;
      for (int64_t i = 0; i < kQK; ++i) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(v[i] * id));
        o.q[i] = static_cast<int8_t>(q);
        s += q;
      }
      o.d = d;
      o.s = s;
      o.ds = d * static_cast<float>(s);
    }
  }
}

// The weights' integer codes of block (row c of the tile, block b) as GGUF stores them: q in
// [0, 15] for Q4, [-128, 127] for Q8.
inline void block_codes(const uint8_t* block, int64_t type, int32_t* q) {
  if (type == kQ8_0) {
    for (int64_t i = 0; i < kQK; ++i) q[i] = static_cast<int8_t>(block[2 + i]);
    return;
  }
  const uint8_t* qs = block + (type == kQ4_1 ? 4 : 2);
  for (int64_t i = 0; i < kQK / 2; ++i) {
    q[i] = qs[i] & 0x0F;
    q[i + kQK / 2] = qs[i] >> 4;
  }
}

// GGUF rows [n][k/32 blocks] -> tiles [ceil(n/16)][k/32][tile_bytes].
inline torch::Tensor pack(const torch::Tensor& raw, int64_t type, int64_t k) {
  TORCH_CHECK(known(type), "unsupported block type ", type);
  TORCH_CHECK(k > 0 && k % kQK == 0, "in_features must be a multiple of ", kQK);
  const int64_t nb = k / kQK, bb = block_bytes(type);
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == torch::kUInt8 && raw.is_contiguous() &&
                  raw.size(1) == nb * bb,
              "raw rows must be contiguous uint8 [n, ", nb * bb, "]");
  const int64_t n = raw.size(0), groups = (n + kCols - 1) / kCols, tb = tile_bytes(type);
  auto packed = torch::zeros({groups, nb, tb}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const int64_t sb = scale_bytes(type);
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    int32_t q[kQK];
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t c = 0; c < kCols && g * kCols + c < n; ++c) {
        const uint8_t* row = src + (g * kCols + c) * nb * bb;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* block = row + b * bb;
          uint8_t* tile = dst + (g * nb + b) * tb;
          std::memcpy(tile + 2 * c, block, 2);                                  // d
          if (type == kQ4_1) std::memcpy(tile + 2 * kCols + 2 * c, block + 2, 2);  // m
          block_codes(block, type, q);
          uint8_t* quants = tile + sb;
          for (int64_t i = 0; i < kQK; ++i) {
            const int64_t quad = i / 4, byte = i % 4;
            if (type == kQ8_0) {
              quants[quad * 64 + c * 4 + byte] = static_cast<uint8_t>(q[i] + 128);
            } else {  // quads 2j and 2j + 1 share chunk j: low and high nibbles
              uint8_t& slot = quants[(quad / 2) * 64 + c * 4 + byte];
              slot |= static_cast<uint8_t>(q[i] << (quad % 2 == 0 ? 0 : 4));
            }
          }
        }
      }
    }
  });
  return packed;
}

// Code of weight i of column c in a tile (the inverse of pack's placement).
inline int32_t tile_code(const uint8_t* tile, int64_t type, int64_t c, int64_t i) {
  const uint8_t* quants = tile + scale_bytes(type);
  const int64_t quad = i / 4, byte = i % 4;
  if (type == kQ8_0) return static_cast<int32_t>(quants[quad * 64 + c * 4 + byte]) - 128;
  const uint8_t v = quants[(quad / 2) * 64 + c * 4 + byte];
  return quad % 2 == 0 ? (v & 0x0F) : (v >> 4);
}

// Weight i of column c of a tile, exactly as gguf's dequantization gives it (d * q, then + m:
// two roundings, never fused, like numpy's).
__attribute__((optimize("fp-contract=off"))) inline float tile_weight(const uint8_t* tile,
                                                                      int64_t type, int64_t c,
                                                                      int64_t i) {
  const float d = half(tile + 2 * c);
  const int32_t offset = type == kQ4_0 ? 8 : 0;
  const float scaled = d * static_cast<float>(tile_code(tile, type, c, i) - offset);
  return type == kQ4_1 ? scaled + half(tile + 2 * kCols + 2 * c) : scaled;
}

// Row `row` of the packed matrix as float32 [k] (an embedding lookup).
inline void dequantize_row(const uint8_t* packed, int64_t type, int64_t k, int64_t row,
                           float* out) {
  const int64_t nb = k / kQK, tb = tile_bytes(type), g = row / kCols, c = row % kCols;
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t i = 0; i < kQK; ++i)
      out[b * kQK + i] = tile_weight(packed + (g * nb + b) * tb, type, c, i);
}

// One contiguous range of work for the kernels below.
struct Operands {
  const XBlock* x;  // rows * nb (int8 activations)
  const float* xf;  // rows of xf_stride (float activations), when x is null
  int64_t xf_stride;
  const uint8_t* w;  // tiles
  int64_t type, nb, n;
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

// The portable kernel: tile group g, rows [m0, m1).
inline void group_portable(const Operands& o, int64_t g, int64_t m0, int64_t m1) {
  const int64_t tb = tile_bytes(o.type);
  for (int64_t m = m0; m < m1; ++m) {
    float acc[kCols] = {};
    for (int64_t b = 0; b < o.nb; ++b) {
      const uint8_t* tile = o.w + (g * o.nb + b) * tb;
      const XBlock& xb = o.x[m * o.nb + b];
      for (int64_t c = 0; c < kCols; ++c) {
        int32_t dot = 0;
        for (int64_t i = 0; i < kQK; ++i) dot += tile_code(tile, o.type, c, i) * xb.q[i];
        if (o.type == kQ4_0) dot -= 8 * xb.s;
        const float d = half(tile + 2 * c);
        acc[c] = std::fma(static_cast<float>(dot), d * xb.d, acc[c]);
        if (o.type == kQ4_1) acc[c] = std::fma(half(tile + 2 * kCols + 2 * c), xb.ds, acc[c]);
      }
    }
    store(o, g, m, acc);
  }
}

// The portable kernel with float activations: one fused multiply-add chain per output, k
// ascending, over the weights as gguf dequantizes them.
inline void group_portable_float(const Operands& o, int64_t g, int64_t m0, int64_t m1) {
  const int64_t tb = tile_bytes(o.type);
  for (int64_t m = m0; m < m1; ++m) {
    const float* x = o.xf + m * o.xf_stride;
    float acc[kCols] = {};
    for (int64_t b = 0; b < o.nb; ++b) {
      const uint8_t* tile = o.w + (g * o.nb + b) * tb;
      for (int64_t i = 0; i < kQK; ++i)
        for (int64_t c = 0; c < kCols; ++c)
          acc[c] = std::fma(x[b * kQK + i], tile_weight(tile, o.type, c, i), acc[c]);
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
  if (o.type == kQ4_0) return tiled<Group, kQ4_0>(o, rows, begin, end);
  if (o.type == kQ4_1) return tiled<Group, kQ4_1>(o, rows, begin, end);
  return tiled<Group, kQ8_0>(o, rows, begin, end);
}

// A tile's per-column scales (and minimums), and where its codes start.
struct TileView {
  __m512 d, mins;
  const uint8_t* quants;
};

template <int64_t T>
inline TileView tile_view(const Operands& o, int64_t g, int64_t b) {
  const uint8_t* tile = o.w + (g * o.nb + b) * tile_bytes(T);
  TileView v{_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile))),
             _mm512_setzero_ps(), tile + scale_bytes(T)};
  if constexpr (T == kQ4_1)
    v.mins = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32)));
  return v;
}

// The codes of quad q (k = 4q .. 4q + 3) of every column: lane c = column c's 4 bytes.
template <int64_t T>
inline __m512i quad_codes(const uint8_t* quants, int q) {
  if constexpr (T == kQ8_0) return _mm512_loadu_si512(quants + 64 * q);
  const __m512i v = _mm512_loadu_si512(quants + 64 * (q / 2));  // low nibbles: even quads
  return _mm512_and_si512(q % 2 == 0 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
}

// R rows of float activations against one tile group: each k's 16 weights are dequantized in
// a vector (as tile_weight does: integer code minus offset, to float, times d, plus m) and
// multiply-added into each row's accumulator.
template <int64_t T, int64_t R>
__attribute__((optimize("fp-contract=off"))) inline void group_float(const Operands& o, int64_t g,
                                                                     int64_t m0) {
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i byte = _mm512_set1_epi32(0xFF);
  const __m512i offset = _mm512_set1_epi32(T == kQ4_0 ? 8 : T == kQ8_0 ? 128 : 0);
  for (int64_t b = 0; b < o.nb; ++b) {
    const TileView t = tile_view<T>(o, g, b);
    for (int q = 0; q < 8; ++q) {
      const __m512i codes = quad_codes<T>(t.quants, q);
      for (int i = 0; i < 4; ++i) {
        const __m512i code = _mm512_and_si512(_mm512_srli_epi32(codes, 8 * i), byte);
        __m512 w = _mm512_mul_ps(t.d, _mm512_cvtepi32_ps(_mm512_sub_epi32(code, offset)));
        if constexpr (T == kQ4_1) w = _mm512_add_ps(w, t.mins);
        const int64_t k = b * kQK + 4 * q + i;
        for (int64_t r = 0; r < R; ++r)
          acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(o.xf[(m0 + r) * o.xf_stride + k]), w, acc[r]);
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
// R rows against one tile group, every block: the tile's 8 vectors of codes are unpacked once
// per block and used by each of the R rows (8 vpdpbusd per row and block).
template <int64_t T, int64_t R>
inline void group_vnni(const Operands& o, int64_t g, int64_t m0) {
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < o.nb; ++b) {
    const TileView t = tile_view<T>(o, g, b);
    __m512i w[8];
    for (int q = 0; q < 8; ++q) w[q] = quad_codes<T>(t.quants, q);
    for (int64_t r = 0; r < R; ++r) {
      const XBlock& xb = o.x[(m0 + r) * o.nb + b];
      const int32_t* xq = reinterpret_cast<const int32_t*>(xb.q);
      __m512i dot = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) dot = _mm512_dpbusd_epi32(dot, w[j], _mm512_set1_epi32(xq[j]));
      if constexpr (T == kQ4_0) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(8 * xb.s));
      if constexpr (T == kQ8_0) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * xb.s));
      const __m512 scale = _mm512_mul_ps(t.d, _mm512_set1_ps(xb.d));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
      if constexpr (T == kQ4_1) acc[r] = _mm512_fmadd_ps(t.mins, _mm512_set1_ps(xb.ds), acc[r]);
    }
  }
  store_rows<R>(o, g, m0, acc);
}

template <int64_t T, int64_t R>
struct VnniGroup {
  static void run(const Operands& o, int64_t g, int64_t m0) { group_vnni<T, R>(o, g, m0); }
};
#endif

inline bool has_vnni() {
#ifdef PDSERVE_QUANT_VNNI
  return true;
#else
  return false;
#endif
}

// Every row against tile groups [begin, end).
inline void groups(const Operands& o, int64_t rows, int64_t begin, int64_t end, bool portable) {
  if (o.x == nullptr) {  // float activations
#if defined(__AVX512F__)
    if (!portable) return tiled_by_type<FloatGroup>(o, rows, begin, end);
#endif
    for (int64_t g = begin; g < end; ++g) group_portable_float(o, g, 0, rows);
    return;
  }
#ifdef PDSERVE_QUANT_VNNI
  if (!portable) return tiled_by_type<VnniGroup>(o, rows, begin, end);
#endif
  for (int64_t g = begin; g < end; ++g) group_portable(o, g, 0, rows);
}

// One matrix of a linear layer: the rows it gives, in one block type. A layer stacking several
// checkpoint matrices (q, k, v) keeps one part per matrix: they may differ in type.
struct Part {
  torch::Tensor tiles;
  int64_t type, n;
};

// A linear layer's weights on their blocks: y = x W^T with W the parts' rows stacked.
class QuantWeight {
 public:
  // float_activations: multiply float32 activations by the weights dequantized in registers
  // (the float path's bits), instead of int8 activations by the codes.
  QuantWeight(int64_t k, bool float_activations)
      : k_(k), float_activations_(float_activations) {
    TORCH_CHECK(k > 0 && k % kQK == 0, "in_features must be a multiple of ", kQK);
  }

  // Append the rows of a GGUF tensor (uint8 [n, k/32 * block bytes]).
  void add(const torch::Tensor& raw, int64_t type) {
    auto tiles = pack(raw, type, k_);
    parts_.push_back(Part{tiles, type, raw.size(0)});
    n_ += raw.size(0);
  }

  int64_t in_features() const { return k_; }
  bool float_activations() const { return float_activations_; }
  int64_t out_features() const { return n_; }
  int64_t nbytes() const {
    int64_t total = 0;
    for (const auto& p : parts_) total += p.tiles.numel();
    return total;
  }
  std::vector<int64_t> types() const {
    std::vector<int64_t> t;
    for (const auto& p : parts_) t.push_back(p.type);
    return t;
  }

  // Raw entry (the fused decode step's): shapes checked by the caller; y may be the residual.
  void into(const float* x, int64_t x_stride, int64_t rows, const float* bias,
            const float* residual, int64_t res_stride, float* y, int64_t y_stride,
            bool portable = false) const {
    if (rows <= 0) return;
    const int64_t nb = k_ / kQK;
    std::vector<XBlock> xq(float_activations_ ? 0 : static_cast<size_t>(rows * nb));
    if (!float_activations_) quantize_rows(x, x_stride, rows, k_, xq.data());
    int64_t offset = 0;
    for (const auto& p : parts_) {
      const Operands o{float_activations_ ? nullptr : xq.data(), x, x_stride,
                       p.tiles.data_ptr<uint8_t>(), p.type, nb, p.n,
                       bias == nullptr ? nullptr : bias + offset,
                       residual == nullptr ? nullptr : residual + offset, res_stride,
                       y + offset, y_stride};
      const int64_t groups_n = (p.n + kCols - 1) / kCols;
      const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
      // One contiguous range of tile groups per thread: the weights stream once.
      const int64_t grain = std::max<int64_t>(1, (groups_n + threads - 1) / threads);
      at::parallel_for(0, groups_n, grain, [&](int64_t begin, int64_t end) {
        groups(o, rows, begin, end, portable);
      });
      offset += p.n;
    }
  }

  // x [M, K] (rows contiguous); bias [N] or None; residual [M, N] or None (after the bias).
  torch::Tensor forward(const torch::Tensor& x, const c10::optional<torch::Tensor>& bias,
                        const c10::optional<torch::Tensor>& residual, bool portable) const {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1 &&
                    x.size(1) == k_,
                "x must be float32 [M, ", k_, "] with contiguous rows");
    const int64_t rows = x.size(0);
    auto y = torch::empty({rows, n_}, x.options());
    const float* b = nullptr;
    const float* r = nullptr;
    int64_t res_stride = 0;
    if (bias.has_value()) {
      TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n_ && bias->is_contiguous() &&
                      bias->scalar_type() == torch::kFloat,
                  "bias must be float32 [out_features]");
      b = bias->data_ptr<float>();
    }
    if (residual.has_value()) {
      TORCH_CHECK(residual->dim() == 2 && residual->size(0) == rows && residual->size(1) == n_ &&
                      residual->stride(1) == 1 && residual->scalar_type() == torch::kFloat,
                  "residual must be float32 [M, N]");
      r = residual->data_ptr<float>();
      res_stride = residual->stride(0);
    }
    into(x.data_ptr<float>(), x.stride(0), rows, b, r, res_stride, y.data_ptr<float>(), n_,
         portable);
    return y;
  }

  // Rows `ids` of W as float32 [len(ids), K] (an embedding table's lookup).
  torch::Tensor rows(const torch::Tensor& ids) const {
    TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kLong, "ids must be int64 [T]");
    const auto flat = ids.contiguous();
    const int64_t count = flat.size(0);
    auto out = torch::empty({count, k_}, torch::TensorOptions().dtype(torch::kFloat));
    const int64_t* id = flat.data_ptr<int64_t>();
    for (int64_t t = 0; t < count; ++t) {
      TORCH_CHECK(id[t] >= 0 && id[t] < n_, "row ", id[t], " outside the table of ", n_);
      int64_t row = id[t];
      for (const auto& p : parts_) {
        if (row < p.n) {
          dequantize_row(p.tiles.data_ptr<uint8_t>(), p.type, k_, row,
                         out.data_ptr<float>() + t * k_);
          break;
        }
        row -= p.n;
      }
    }
    return out;
  }

 private:
  int64_t k_, n_ = 0;
  bool float_activations_;
  std::vector<Part> parts_;
};

inline void bind(pybind11::module& m) {
  using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;
  pybind11::class_<QuantWeight, std::shared_ptr<QuantWeight>>(m, "QuantWeight")
      .def(pybind11::init<int64_t, bool>(), pybind11::arg("in_features"),
           pybind11::arg("float_activations") = false)
      .def("add", &QuantWeight::add, "Append GGUF rows (uint8 [n, row bytes]) of a block type")
      .def_property_readonly("in_features", &QuantWeight::in_features)
      .def_property_readonly("float_activations", &QuantWeight::float_activations)
      .def_property_readonly("out_features", &QuantWeight::out_features)
      .def_property_readonly("nbytes", &QuantWeight::nbytes)
      .def_property_readonly("types", &QuantWeight::types)
      .def("forward", &QuantWeight::forward, pybind11::arg("x"),
           pybind11::arg("bias") = pybind11::none(), pybind11::arg("residual") = pybind11::none(),
           pybind11::arg("portable") = false, NoGil())
      .def("rows", &QuantWeight::rows, "Rows of W as float32 (embedding lookups)", NoGil());
  m.def("quant_has_vnni", &has_vnni, "Whether the AVX-512 VNNI kernel was built");
}

}  // namespace pdserve::quant
