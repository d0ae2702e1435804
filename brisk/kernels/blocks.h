// GGUF block-quantized weights as stored in the file, and the activations their kernels multiply
// (cpu_blocks.cpp; quant/gguf.py BlockLinear). One layout per GGML type, read where it lies: a
// weight row is its blocks back to back, as llama.cpp writes them.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace brisk_blocks {

// GGML type ids (gguf.GGMLQuantizationType) with a native kernel.
enum Type : int {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13,
  kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23,
};

// brisk's own layouts beside the file's: a type id with kTiled set holds its GGML type's blocks
// repacked four weight rows at a time (cpu_blocks_simd.inc, "tiles"): the same bytes in the same
// [out, row bytes] tensor, so shapes and sizes are the GGML type's; only the kernels read them.
constexpr int kTiled = 1024;
constexpr int kQ4_0x4 = kQ4_0 | kTiled;  // Q4_0, rows 4t..4t+3 interleaved block by block
constexpr int kQ4_1x4 = kQ4_1 | kTiled;  // Q4_1, Q5_0, Q5_1: the same
constexpr int kQ5_0x4 = kQ5_0 | kTiled;
constexpr int kQ5_1x4 = kQ5_1 | kTiled;
constexpr int kIQ4_NLx4 = kIQ4_NL | kTiled;  // Q4_0's layout, its nibbles indices into kIq4Values
constexpr int kQ4_Kx4 = kQ4_K | kTiled;  // the K-quants: see k_tiled below
constexpr int kQ5_Kx4 = kQ5_K | kTiled;
constexpr int kQ6_Kx4 = kQ6_K | kTiled;
constexpr int kQ3_Kx4 = kQ3_K | kTiled;
constexpr int kQ2_Kx4 = kQ2_K | kTiled;
constexpr int kIQ4_XSx4 = kIQ4_XS | kTiled;
inline bool is_tiled(int type) { return (type & kTiled) != 0; }
inline int file_type(int type) { return type & ~kTiled; }
// A tile is, per 32-column block, the 4 rows' fp16 d ([0, 8)), for Q4_1 / Q5_1 their fp16 min
// ([8, 16)), for Q5_0 / Q5_1 their 128 fifth bits (16 bytes), then their nibbles as the file
// stores them (64 bytes, rows in the order 0, 2, 1, 3, so one 32-byte load holds rows 0 and 2 and
// another rows 1 and 3): four blocks' bytes, 4 x 18, 20, 22 or 24. Fifth bit of row i, column j:
// bit tile_bit(i, j) of byte tile_head + j % 16. The bits sit where one variable shift of the
// broadcast field lines up a whole vector's bits at 0x10 (cpu_blocks_simd.inc tile_x4).
constexpr bool tile_mins(int type) { return type == kQ4_1 || type == kQ5_1; }  // GGML type: w = d q + min
constexpr int kTileMinsAt = 8;  // where a tile's 4 fp16 mins start, after the 4 d
constexpr int tile_head(int type) { return tile_mins(type) ? kTileMinsAt + 8 : kTileMinsAt; }  // bytes of d (and min)
constexpr int tile_high(int type) { return type == kQ5_0 || type == kQ5_1 ? 16 : 0; }  // bytes of fifth bits
constexpr int tile_qs(int type) { return tile_head(type) + tile_high(type); }  // where the nibbles start
template <int T>
constexpr bool kTileMins = tile_mins(T);
template <int T>
constexpr int kTileHead = tile_head(T);
template <int T>
constexpr int kTileHigh = tile_high(T);
template <int T>
constexpr int kTileQs = tile_qs(T);
template <int T>
constexpr int kTileBytes = 64 + kTileQs<T>;
// A K-quant tile (Q2_K ... Q6_K) is, per 256-column block of its 4 rows: their fp16 d ([0, 8)),
// Q2_K / Q4_K / Q5_K their fp16 dmin ([8, 16)); then their scales laid out for the kernel's lanes
// (ktile_x4): Q4_K / Q5_K the 6-bit scales and mins unpacked to bytes, 8 bytes per pair q, q + 4 of
// 32-column sub-blocks ([sc_q of rows 0-3, sc_q+4 of rows 0-3] at 16 + 8q, the mins alike at
// 48 + 8q); Q6_K its int8 scales, Q3_K its 6-bit ones less 32 as int8 and Q2_K its scale | min
// bytes, 8 bytes per sub-block j ([unit 2j of rows 0-3, unit 2j + 1 of rows 0-3] at 8 + 8j, Q2_K
// 16 + 8j); then each row's quants as the file stores them (Q2_K qs; Q3_K hmask, qs; Q4_K qs; Q5_K
// qh, qs; Q6_K ql, qh). Q2_K's and Q6_K's tiles are the same bytes moved; the others' scales take 16
// bytes a row instead of 12 (+2.8% Q4_K / Q5_K, +3.6% Q3_K). IQ4_XS (a 6-bit scale per 32 columns, no
// min) is Q4_K's form: d of rows 0-3, its scales less 32 as int8 at 8 + 8q, then each row's qs (+1.5%).
constexpr bool k_tiled(int type) { return (type >= kQ2_K && type <= kQ6_K) || type == kIQ4_XS; }
constexpr bool k_fine(int type) { return type == kQ2_K || type == kQ3_K || type == kQ6_K; }  // a scale per 16 columns
constexpr int ktile_head(int type) {  // d (dmin) and the scales
  return type == kIQ4_XS ? 40 : type == kQ3_K || type == kQ6_K ? 72 : 80;
}
constexpr int ktile_rest(int type) {  // a row's quants
  return type == kQ2_K ? 64 : type == kQ3_K ? 96 : type == kQ4_K || type == kIQ4_XS ? 128 : type == kQ5_K ? 160 : 192;
}
constexpr int ktile_rest_at(int type) {  // where they start in a file block
  return type == kQ3_K || type == kQ6_K ? 0 : type == kIQ4_XS ? 8 : 16;
}
constexpr int ktile_bytes(int type) { return ktile_head(type) + 4 * ktile_rest(type); }  // one tile block
template <int T>
constexpr int kKHead = ktile_head(T);
template <int T>
constexpr int kKRest = ktile_rest(T);
template <int T>
constexpr int kKBytes = ktile_bytes(T);
constexpr int tile_bit(int i, int j) { return ((i & 1) ? 0 : 4) + 2 * (j / 16) + (i >> 1); }
constexpr int tile_nibbles(int i, int qs) { return qs + 16 * (2 * (i & 1) + (i >> 1)); }  // row i's 16 bytes

// fn(std::integral_constant<int, T>{}) for the block type T == type (the one switch over types);
// `otherwise` when no kernel runs it.
template <typename Fn, typename... Otherwise>
auto visit_type(int type, Fn&& fn, Otherwise... otherwise) {
  using R = decltype(fn(std::integral_constant<int, kQ4_0>{}));
  switch (type) {
    case kQ4_0: return fn(std::integral_constant<int, kQ4_0>{});
    case kQ4_1: return fn(std::integral_constant<int, kQ4_1>{});
    case kQ5_0: return fn(std::integral_constant<int, kQ5_0>{});
    case kQ5_1: return fn(std::integral_constant<int, kQ5_1>{});
    case kQ8_0: return fn(std::integral_constant<int, kQ8_0>{});
    case kIQ4_NL: return fn(std::integral_constant<int, kIQ4_NL>{});
    case kIQ4_XS: return fn(std::integral_constant<int, kIQ4_XS>{});
    case kQ2_K: return fn(std::integral_constant<int, kQ2_K>{});
    case kQ3_K: return fn(std::integral_constant<int, kQ3_K>{});
    case kQ4_K: return fn(std::integral_constant<int, kQ4_K>{});
    case kQ5_K: return fn(std::integral_constant<int, kQ5_K>{});
    case kQ6_K: return fn(std::integral_constant<int, kQ6_K>{});
    default:
      if constexpr (sizeof...(otherwise) > 0) return R(otherwise...);
      else return R();
  }
}

// fn(std::integral_constant<int, T>{}) for the tiled type kTiled | T (T its GGML type: the one
// switch over tiled types); `otherwise` when `type` is no tiled type with a kernel.
template <typename Fn, typename... Otherwise>
auto visit_tiled(int type, Fn&& fn, Otherwise... otherwise) {
  using R = decltype(fn(std::integral_constant<int, kQ4_0>{}));
  switch (type) {
    case kQ4_0x4: return fn(std::integral_constant<int, kQ4_0>{});
    case kQ4_1x4: return fn(std::integral_constant<int, kQ4_1>{});
    case kQ5_0x4: return fn(std::integral_constant<int, kQ5_0>{});
    case kQ5_1x4: return fn(std::integral_constant<int, kQ5_1>{});
    case kIQ4_NLx4: return fn(std::integral_constant<int, kIQ4_NL>{});
    case kQ4_Kx4: return fn(std::integral_constant<int, kQ4_K>{});
    case kQ5_Kx4: return fn(std::integral_constant<int, kQ5_K>{});
    case kQ6_Kx4: return fn(std::integral_constant<int, kQ6_K>{});
    case kQ3_Kx4: return fn(std::integral_constant<int, kQ3_K>{});
    case kQ2_Kx4: return fn(std::integral_constant<int, kQ2_K>{});
    case kIQ4_XSx4: return fn(std::integral_constant<int, kIQ4_XS>{});
    default:
      if constexpr (sizeof...(otherwise) > 0) return R(otherwise...);
      else return R();
  }
}

// The constant zero point of the types that have one (w = d (q - z), q unsigned); 0 for the
// others. The dot products fold it in as integers: sum (q - z) x = sum q x - z sum x, with
// -z sum x per 4 columns precomputed with the activations (BlockActs::zsum), so the weights are
// never shifted and the unsigned q meet signed x directly.
template <int T>
constexpr int kZeroPoint = T == kQ4_0 ? 8 : T == kQ5_0 ? 16 : T == kQ6_K ? 32 : T == kQ3_K ? 4 : 0;
constexpr int kZeroPoints[4] = {4, 8, 16, 32};  // BlockActs::zsum's order
constexpr int zero_slot(int z) { return z == 4 ? 0 : z == 8 ? 1 : z == 16 ? 2 : 3; }

bool supported(int type);      // a GGML type with a kernel, or a tiled one (kQ4_0x4 ... kQ6_Kx4)
int64_t block_cols(int type);   // 32 or 256
int64_t block_bytes(int type);  // of one row's block (a tiled type: its GGML type's; K-quant tiles: a quarter of ktile_bytes)

// Rows of a type with tiles (file layout, rows % 4 == 0) -> that type's tiles, and one row's blocks back
// (`type` the GGML type).
void tile_rows_of(int type, const uint8_t* src, uint8_t* dst, int64_t rows, int64_t nblocks);
void untile_row(int type, const uint8_t* tiles, int64_t row, int64_t nblocks, uint8_t* out);

// One stacked part of a Linear: `out` rows of one type (a fused qkv may mix Q4_K and Q6_K).
struct Segment {
  const uint8_t* q = nullptr;
  int type = 0;
  int64_t out = 0, in = 0, row_bytes = 0, first_row = 0;  // first_row: where it starts in y
};

// x [m, in] in 32-column blocks: q = round-half-even(x / a), a = max |x| / 127 (0 for a zero
// block), and per 16- and 32-column run a * (sum of its q): the offset terms of weights stored
// with a minimum or a bias (w = d q - m).
struct BlockActs {
  std::vector<int8_t> q;
  std::vector<uint8_t> qu;  // q + 128 as unsigned bytes: vpdpbusd's unsigned side for signed weights
  std::vector<float> a, c16, c32;
  std::vector<float> a8;  // a repeated 8 times: one 256-bit load per block (the AVX-512 path)
  // zsum[zero_slot(z)][row * in / 4 + l] = -z * (q[4 l] + ... + q[4 l + 3]): vpdpbusd's starting
  // lanes for weights with the constant zero point z
  std::vector<int32_t> zsum[4];
  // zpair[zero_slot(z)][(row * in / 32 + b) * 2 + h] = -z x the sum of block b's q over columns
  // 0-7 and 16-23 (h = 0) or 8-15 and 24-31 (h = 1): the tiles' zero terms, in their lanes' order
  std::vector<int32_t> zpair[4];
  int64_t m = 0, in = 0;
};

void quantize_acts(const float* x, int64_t m, int64_t in, BlockActs& out);

// y [m, out_total] columns [r0, r1) (global rows across `segs`) of acts @ W^T, no bias.
void rows(const std::vector<Segment>& segs, const BlockActs& x, float* y, int64_t out_total, int64_t r0, int64_t r1);

}  // namespace brisk_blocks
