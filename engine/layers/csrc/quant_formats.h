// llama.cpp's block formats, and the tiles quant_gemm.h computes on.
//
// GGUF blocks (bytes per block of a row):
//   Q4_0 (32 weights, 18 B): f16 d, 16 B of nibbles          w = d * (q - 8)
//   Q4_1 (32, 20 B):         f16 d, f16 m, 16 B of nibbles   w = d * q + m
//   Q8_0 (32, 34 B):         f16 d, 32 int8                  w = d * q
//   Q4_K (256, 144 B): f16 d, f16 dmin, 12 B of 6-bit scales and minimums of 8 sub-blocks of 32,
//                      128 B of nibbles                       w = (d * sc_j) * q - dmin * m_j
//   Q5_K (256, 176 B): as Q4_K, plus 32 B holding each weight's fifth bit
//   Q6_K (256, 210 B): 128 B low nibbles, 64 B high 2 bits, 16 int8 scales of sub-blocks of
//                      16, f16 d                              w = (d * sc_j) * (q - 32)
// (`tile_weight` computes w exactly as the gguf package dequantizes it: float32, in its order.)
//
// A tile is 16 output columns by one GGUF block: the columns' block headers side by side
// (f16 scales, then minimums, then the K types' per-sub-block 6- or 8-bit scales as bytes,
// [sub-block][column]), then each sub-block of 32 weights as code vectors: one 32-bit lane per
// column holding its next 4 codes, the operand AVX-512's vpdpbusd multiplies with 4 activations
// broadcast to every lane. 4-bit codes (Q4_0, Q4_1, Q4_K) are nibbles, two quads per byte: byte
// i of lane c of chunk j is q[c][8j + i] | q[c][8j + 4 + i] << 4. Wider codes are bytes: Q8_0's
// q + 128 (vpdpbusd multiplies unsigned by signed; the kernels subtract 128 * sum(x)), Q5_K's
// 0..31, Q6_K's 0..63. Tiles take the blocks' bytes, except that Q5_K's and Q6_K's codes take a
// byte each, with their scales (1.57x and 1.30x the file's bytes for those tensors), and
// Q4_K's packed 6-bit scales a byte each (~3%). Tail columns (N not a multiple of 16) are zero tiles: scale 0.

#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace pdserve::quant {

// GGML's type ids: what the GGUF file says of each tensor.
enum Type : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

constexpr int64_t kCols = 16;  // output columns per tile
constexpr int64_t kQK = 32;    // weights per sub-block (and per block of activations)

inline bool known(int64_t t) {
  return t == kQ4_0 || t == kQ4_1 || t == kQ8_0 || t == kQ4_K || t == kQ5_K || t == kQ6_K;
}
constexpr bool k_type(int64_t t) { return t == kQ4_K || t == kQ5_K || t == kQ6_K; }
constexpr bool nibbles(int64_t t) { return t == kQ4_0 || t == kQ4_1 || t == kQ4_K; }

// Weights per GGUF block, and its bytes.
constexpr int64_t block_weights(int64_t t) { return k_type(t) ? 256 : kQK; }
constexpr int64_t block_bytes(int64_t t) {
  return t == kQ4_0 ? 18 : t == kQ4_1 ? 20 : t == kQ8_0 ? 34 : t == kQ4_K ? 144
       : t == kQ5_K ? 176 : 210;
}
constexpr int64_t sub_blocks(int64_t t) { return block_weights(t) / kQK; }

// Tile layout: header bytes, where each header field starts, bytes of a sub-block's codes.
constexpr int64_t kHalves = 2 * kCols;  // 16 float16
constexpr int64_t header_bytes(int64_t t) {
  return t == kQ4_1 ? 2 * kHalves
       : (t == kQ4_K || t == kQ5_K) ? 2 * kHalves + 2 * 8 * kCols
       : t == kQ6_K ? kHalves + 16 * kCols
                    : kHalves;
}
constexpr int64_t kMinOffset = kHalves;                     // Q4_1's m, the K types' dmin
constexpr int64_t kScaleOffset = 2 * kHalves;               // Q4_K/Q5_K sc [8][16]
constexpr int64_t kSubMinOffset = 2 * kHalves + 8 * kCols;  // Q4_K/Q5_K m [8][16]
constexpr int64_t kQ6ScaleOffset = kHalves;                 // Q6_K sc [16][16], int8
constexpr int64_t code_bytes(int64_t t) { return nibbles(t) ? kCols * kQK / 2 : kCols * kQK; }
constexpr int64_t tile_bytes(int64_t t) { return header_bytes(t) + sub_blocks(t) * code_bytes(t); }

inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// One GGUF block decoded: its codes (as the tile stores them) and per-sub-block scale bytes.
struct Decoded {
  int32_t code[256];
  uint8_t sc[16];  // Q4_K/Q5_K: 8 six-bit scales; Q6_K: 16 int8 scales (as bytes)
  uint8_t mn[8];   // Q4_K/Q5_K: 8 six-bit minimums
};

// Q4_K's and Q5_K's 12 bytes of 6-bit scales and minimums (llama.cpp's get_scale_min_k4).
inline void k4_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      sc[j] = s[j] & 63;
      mn[j] = s[j + 4] & 63;
    } else {
      sc[j] = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
      mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
  }
}

inline void decode_block(const uint8_t* block, int64_t t, Decoded& out) {
  if (t == kQ8_0) {
    for (int i = 0; i < kQK; ++i) out.code[i] = static_cast<int8_t>(block[2 + i]) + 128;
  } else if (t == kQ4_0 || t == kQ4_1) {
    const uint8_t* qs = block + (t == kQ4_1 ? 4 : 2);
    for (int i = 0; i < kQK / 2; ++i) {
      out.code[i] = qs[i] & 0x0F;
      out.code[i + kQK / 2] = qs[i] >> 4;
    }
  } else if (t == kQ4_K || t == kQ5_K) {  // 4 chunks of 64: low nibbles, then high
    k4_scales(block + 4, out.sc, out.mn);
    const uint8_t* qh = block + 16;
    const uint8_t* qs = block + (t == kQ5_K ? 48 : 16);
    for (int e = 0; e < 256; ++e) {
      const int chunk = e / 64, high = (e % 64) / 32, l = e % 32, sub = e / 32;
      int32_t q = (qs[32 * chunk + l] >> (4 * high)) & 0x0F;
      if (t == kQ5_K) q |= ((qh[l] >> sub) & 1) << 4;
      out.code[e] = q;
    }
  } else {  // Q6_K: 2 halves of 128; low nibbles from ql, 2 high bits from qh
    const uint8_t* ql = block;
    const uint8_t* qh = block + 128;
    std::memcpy(out.sc, block + 192, 16);
    for (int e = 0; e < 256; ++e) {
      const int h = e / 128, r = e % 128;
      const int32_t low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F;
      const int32_t high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 0x03;
      out.code[e] = low | high << 4;
    }
  }
}

// Column c's header fields of one block into its tile.
inline void place_header(const uint8_t* block, int64_t t, const Decoded& dec, int64_t c,
                         uint8_t* tile) {
  std::memcpy(tile + 2 * c, block + (t == kQ6_K ? 208 : 0), 2);       // d
  if (t == kQ4_1 || t == kQ4_K || t == kQ5_K)
    std::memcpy(tile + kMinOffset + 2 * c, block + 2, 2);             // m, dmin
  if (t == kQ4_K || t == kQ5_K) {
    for (int j = 0; j < 8; ++j) {
      tile[kScaleOffset + j * kCols + c] = dec.sc[j];
      tile[kSubMinOffset + j * kCols + c] = dec.mn[j];
    }
  }
  if (t == kQ6_K)
    for (int j = 0; j < 16; ++j) tile[kQ6ScaleOffset + j * kCols + c] = dec.sc[j];
}

// Where code i (0..31) of column c sits in a sub-block's code bytes, and in which nibble.
inline int64_t code_slot(int64_t t, int64_t c, int64_t i, int* shift) {
  const int64_t quad = i / 4, byte = i % 4;
  if (!nibbles(t)) {
    *shift = 0;
    return quad * 64 + c * 4 + byte;
  }
  *shift = quad % 2 == 0 ? 0 : 4;  // quads 2j and 2j + 1 share chunk j
  return (quad / 2) * 64 + c * 4 + byte;
}

// GGUF rows [n][k / block weights blocks] -> tiles [ceil(n/16)][k / block weights][tile bytes].
inline torch::Tensor pack(const torch::Tensor& raw, int64_t t, int64_t k) {
  TORCH_CHECK(known(t), "unsupported block type ", t);
  const int64_t bw = block_weights(t), bb = block_bytes(t);
  TORCH_CHECK(k > 0 && k % bw == 0, "in_features must be a multiple of ", bw);
  const int64_t nb = k / bw;
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == torch::kUInt8 && raw.is_contiguous() &&
                  raw.size(1) == nb * bb,
              "raw rows must be contiguous uint8 [n, ", nb * bb, "]");
  const int64_t n = raw.size(0), groups = (n + kCols - 1) / kCols, tb = tile_bytes(t);
  auto packed = torch::zeros({groups, nb, tb}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    Decoded dec;
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t c = 0; c < kCols && g * kCols + c < n; ++c) {
        const uint8_t* row = src + (g * kCols + c) * nb * bb;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* block = row + b * bb;
          uint8_t* tile = dst + (g * nb + b) * tb;
          decode_block(block, t, dec);
          place_header(block, t, dec, c, tile);
          for (int64_t e = 0; e < bw; ++e) {
            uint8_t* codes = tile + header_bytes(t) + (e / kQK) * code_bytes(t);
            int shift;
            codes[code_slot(t, c, e % kQK, &shift)] |= static_cast<uint8_t>(dec.code[e] << shift);
          }
        }
      }
    }
  });
  return packed;
}

// Code of weight e (0 .. block weights - 1) of column c in a tile.
inline int32_t tile_code(const uint8_t* tile, int64_t t, int64_t c, int64_t e) {
  const uint8_t* codes = tile + header_bytes(t) + (e / kQK) * code_bytes(t);
  int shift;
  const uint8_t v = codes[code_slot(t, c, e % kQK, &shift)];
  return nibbles(t) ? (v >> shift) & 0x0F : v;
}

// The integer the weight's scale multiplies: the code less its format's offset.
inline int32_t tile_q(const uint8_t* tile, int64_t t, int64_t c, int64_t e) {
  const int32_t offset = t == kQ4_0 ? 8 : t == kQ8_0 ? 128 : t == kQ6_K ? 32 : 0;
  return tile_code(tile, t, c, e) - offset;
}

// Column c's scale of sub-block j (of 32; Q6_K: of 16), and minimum, as gguf computes them.
inline float tile_scale(const uint8_t* tile, int64_t t, int64_t c, int64_t j) {
  const float d = half(tile + 2 * c);
  if (t == kQ4_K || t == kQ5_K) return d * static_cast<float>(tile[kScaleOffset + j * kCols + c]);
  if (t == kQ6_K)
    return d * static_cast<float>(static_cast<int8_t>(tile[kQ6ScaleOffset + j * kCols + c]));
  return d;
}
inline float tile_min(const uint8_t* tile, int64_t t, int64_t c, int64_t j) {
  const float m = half(tile + kMinOffset + 2 * c);
  if (t == kQ4_K || t == kQ5_K) return m * static_cast<float>(tile[kSubMinOffset + j * kCols + c]);
  return m;  // Q4_1
}

// Weight e of column c, exactly as the gguf package dequantizes it (float32, its order of
// operations, each product rounded before it is added: the float path's weight). The
// intermediates are volatile so that no compiler fuses a multiply and an add (the module is
// built with -ffp-contract=fast for the kernels that want exactly that).
inline float tile_weight(const uint8_t* tile, int64_t t, int64_t c, int64_t e) {
  const float q = static_cast<float>(tile_q(tile, t, c, e));
  if (t == kQ6_K) return tile_scale(tile, t, c, e / 16) * q;
  volatile float scaled = tile_scale(tile, t, c, e / kQK) * q;
  if (t == kQ4_1) {
    volatile float m = tile_min(tile, t, c, 0);
    return scaled + m;
  }
  if (t == kQ4_K || t == kQ5_K) {
    volatile float m = tile_min(tile, t, c, e / kQK);
    return scaled - m;
  }
  return scaled;
}

// Row `row` of the packed matrix as float32 [k] (an embedding lookup).
inline void dequantize_row(const uint8_t* packed, int64_t t, int64_t k, int64_t row, float* out) {
  const int64_t bw = block_weights(t), nb = k / bw, tb = tile_bytes(t);
  const int64_t g = row / kCols, c = row % kCols;
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t e = 0; e < bw; ++e)
      out[b * bw + e] = tile_weight(packed + (g * nb + b) * tb, t, c, e);
}

}  // namespace pdserve::quant
