// GGUF block-quantized weights multiplied as stored (quant/gguf.py BlockLinear), the way llama.cpp
// multiplies them: x is quantized to int8 in 32-column blocks (brisk_blocks::BlockActs), each
// 32-column sub-block of a weight row is decoded to 32 small integers q with a float scale d and
// offset m (w = d q - m; finer types carry one pair per 16 columns), and
//
//     row . x  =  sum over sub-blocks  a_b (d  sum_i q_i x_i)  -  m (a_b sum_i x_i)
//
// with the integer sums in vpdpbusd (AVX512-VNNI, or AVX-VNNI's 256-bit form at the AVX2 level
// where the CPU has it) or vpmaddubsw + vpmaddwd (AVX2), one float
// multiply-add per sub-block and x row, and the offset sums precomputed per x block. Weights are
// read once per call whatever the number of x rows (up to 4 share each decoded sub-block, and 8
// weight rows stay in L1 while all x rows pass), so decode reads the file's bytes at memory speed
// and prompt work does not dequantize a matrix per call.
//
// Every path (portable, AVX2, AVX-VNNI, AVX-512) computes the same integers and then the same float
// operations in the same order, so its output is bit-identical on every CPU, and a row's result
// never depends on the other rows in the call (batch invariance).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "blocks.h"
#include "kernels.h"
#include "simd.h"

namespace brisk_blocks {
namespace {

alignas(16) constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};

// ---- the portable path: each SIMD step of cpu_blocks_simd.inc, one lane at a time ------------
namespace portable {

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

#include "cpu_blocks_format.inc"

inline void nibbles16(const uint8_t* p, int8_t* q) {
  for (int l = 0; l < 16; ++l) q[l] = static_cast<int8_t>(p[l] & 0x0F), q[l + 16] = static_cast<int8_t>(p[l] >> 4);
}

inline void fifth_bits(const uint8_t* p, int8_t* q) {
  for (int l = 0; l < 32; ++l) q[l] = static_cast<int8_t>(q[l] | (((p[l / 8] >> (l % 8)) & 1) << 4));
}

// Signed types get their constant zero point subtracted (Format's kSigned).
template <int T>
constexpr int kZero = kZeroPoint<T>;

template <int T>
void quants_raw(const uint8_t* b, int j, int8_t* q) {
  if constexpr (T == kQ4_0 || T == kQ4_1 || T == kIQ4_NL || T == kIQ4_XS) {
    nibbles16(b + (T == kQ4_1 ? 4 : T == kIQ4_XS ? 8 + 16 * j : 2), q);
    if constexpr (T == kIQ4_NL || T == kIQ4_XS)
      for (int l = 0; l < 32; ++l) q[l] = kIq4Values[q[l]];
  } else if constexpr (T == kQ5_0 || T == kQ5_1) {
    nibbles16(b + (T == kQ5_0 ? 6 : 8), q);
    fifth_bits(b + (T == kQ5_0 ? 2 : 4), q);
  } else if constexpr (T == kQ8_0) {
    std::memcpy(q, b + 2, 32);
  } else {
    for (int l = 0; l < 32; ++l) {
      int v = 0;
      if constexpr (T == kQ4_K) v = (b[16 + 32 * (j >> 1) + l] >> (4 * (j & 1))) & 0x0F;
      if constexpr (T == kQ5_K) v = ((b[48 + 32 * (j >> 1) + l] >> (4 * (j & 1))) & 0x0F) | (((b[16 + l] >> j) & 1) << 4);
      if constexpr (T == kQ6_K) {
        const int h = j >> 2, jj = j & 3;
        v = ((b[64 * h + 32 * (jj & 1) + l] >> (4 * (jj >> 1))) & 0x0F) | (((b[128 + 32 * h + l] >> (2 * jj)) & 3) << 4);
      }
      if constexpr (T == kQ3_K) v = ((b[32 + 32 * (j >> 2) + l] >> (2 * (j & 3))) & 3) | (((b[l] >> j) & 1) << 2);
      if constexpr (T == kQ2_K) v = (b[16 + 32 * (j >> 2) + l] >> (2 * (j & 3))) & 3;
      q[l] = static_cast<int8_t>(v);
    }
  }
}

template <int T>
void quants(const uint8_t* b, int j, int8_t* q) {
  quants_raw<T>(b, j, q);
  if constexpr (kZero<T> != 0)
    for (int l = 0; l < 32; ++l) q[l] = static_cast<int8_t>(q[l] - kZero<T>);
}

inline float hsum(const float* t) {
  float u[4];
  for (int i = 0; i < 4; ++i) u[i] = t[i] + t[i + 4];
  const float v0 = u[0] + u[2], v1 = u[1] + u[3];
  return v0 + v1;
}

template <int T>
float row_dot(const uint8_t* row, int64_t nblocks, const BlockActs& x, int64_t xr) {
  using F = Format<T>;
  constexpr int kSub = F::kCols / 32;
  float acc[2][8] = {};
  float lanes[8] = {}, one = 0.0f;
  const int64_t in = x.in;
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const uint8_t* b = row + blk * F::kBytes;
    float ds[16], dm[16];
    F::scales(b, ds, dm);
    for (int j = 0; j < kSub; ++j) {
      const int64_t col = blk * F::kCols + 32 * j;
      int8_t w[32];
      quants<T>(b, j, w);
      const int8_t* xq = x.q.data() + xr * in + col;
      const float a = x.a[xr * (in / 32) + col / 32];
      for (int l = 0; l < 8; ++l) {
        int32_t isum = 0;
        for (int i = 4 * l; i < 4 * l + 4; ++i) {
          isum += static_cast<int32_t>(w[i]) * xq[i];  // |w| x sign(w) as vpsignb, or w in 0..63
        }
        const float sv = F::kFine ? ds[2 * j + l / 4] : ds[j];
        acc[col / 32 & 1][l] = std::fma(static_cast<float>(isum) * sv, a, acc[col / 32 & 1][l]);
      }
    }
    offsets<T>(dm, x, xr, blk, lanes, one);
  }
  float t[8];
  for (int l = 0; l < 8; ++l) t[l] = acc[0][l] + acc[1][l];
  return hsum(t) - (hsum(lanes) + one);
}

template <int T>
void segment_rows(const Segment& s, const BlockActs& x, float* y, int64_t out_total, int64_t r0, int64_t r1) {
  const int64_t nblocks = s.in / Format<T>::kCols;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t k = 0; k < x.m; ++k) y[k * out_total + s.first_row + r] = row_dot<T>(s.q + r * s.row_bytes, nblocks, x, k);
}

// Rows 4t..4t+3 of a tiled weight (T its GGML type) . x row xr (cpu_blocks_simd.inc tile_x4, one
// lane at a time): per row, two int32 lanes (columns 0-7 and 16-23; 8-15 and 24-31) with their
// zero terms, then d and a as every block type; Q4_1 / Q5_1's mins as row_dot's offsets (w = d q
// - m with m = -min, summed apart and subtracted at the end).
template <int T>
void tile_x4(const uint8_t* p, int64_t nblocks, const BlockActs& x, int64_t xr, float* out) {
  float acc[4][2] = {}, mins[4] = {};
  const int64_t in = x.in, in32 = in / 32;
  const int32_t* zp = kZeroPoint<T> ? x.zpair[zero_slot(kZeroPoint<T>)].data() + xr * in32 * 2 : nullptr;
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const uint8_t* b = p + blk * kTileBytes<T>;
    const int8_t* xq = x.q.data() + xr * in + 32 * blk;
    const float a = x.a[xr * in32 + blk];
    for (int i = 0; i < 4; ++i) {
      const float d = f16(b + 2 * i);
      for (int h = 0; h < 2; ++h) {
        int32_t isum = zp ? zp[blk * 2 + h] : 0;
        for (int u = 0; u < 2; ++u)
          for (int c = 8 * h; c < 8 * h + 8; ++c) {
            const int j = 16 * u + c, nib = b[tile_nibbles(i, kTileQs<T>) + c];
            const int high = kTileHigh<T> ? ((b[kTileHead<T> + c] >> tile_bit(i, j)) & 1) << 4 : 0;
            const int q = ((u ? nib >> 4 : nib) & 0x0F) | high;
            isum += (T == kIQ4_NL ? kIq4Values[q] : q) * xq[j];
          }
        acc[i][h] = std::fma(static_cast<float>(isum) * d, a, acc[i][h]);
      }
      if constexpr (kTileMins<T>) mins[i] = std::fma(-f16(b + kTileMinsAt + 2 * i), x.c32[xr * in32 + blk], mins[i]);
    }
  }
  for (int i = 0; i < 4; ++i) out[i] = (acc[i][0] + acc[i][1]) - mins[i];
}

// Rows 4t..4t+3 of a K-quant tile (blocks.h k_tiled) . x row xr (cpu_blocks_simd.inc ktile_x4, one
// lane at a time). Q4_K / Q5_K: per 32-column sub-block u of row i, its whole integer sum, times
// d sc_u, times a, summed in lane (i, u / 4): sub-blocks u and u + 4 side by side, as the SIMD form
// takes them; the mins dmin m_u x (a x sum of x's q) in lanes of their own, subtracted at the end.
// Q6_K / Q3_K / Q2_K: per sub-block and row, the sums of columns 0-15 and 16-31 (zero point 32 / 4
// folded in), each times its 16 columns' d sc, times a, in lanes (i, 0) and (i, 1); Q2_K's mins per
// 16 columns as Q4_K's per 32.
template <int T>
void ktile_x4(const uint8_t* p, int64_t nblocks, const BlockActs& x, int64_t xr, float* out) {
  float acc[4][2] = {}, mins[4][2] = {};
  const int64_t in = x.in, in32 = in / 32;
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const uint8_t* b = p + blk * kKBytes<T>;
    for (int i = 0; i < 4; ++i) {
      // the file block's quants sit at ktile_rest_at(T): quants_raw reads them where they would be
      const uint8_t* quants_at = b + kKHead<T> + i * kKRest<T> - ktile_rest_at(T);
      const float d = f16(b + 2 * i);
      for (int u = 0; u < 8; ++u) {
        const int64_t sub = blk * 8 + u;
        const int8_t* xq = x.q.data() + xr * in + 32 * sub;
        const float a = x.a[xr * in32 + sub];
        int8_t w[32];
        quants_raw<T>(quants_at, u, w);
        if constexpr (k_fine(T)) {
          for (int h = 0; h < 2; ++h) {
            int32_t isum = 0;
            for (int c = 16 * h; c < 16 * h + 16; ++c) isum += (w[c] - kZeroPoint<T>) * xq[c];
            if constexpr (T == kQ2_K) {  // scale | min << 4, dmin x min x (a x sum of x's q over the 16 columns)
              const uint8_t sm = b[16 + 8 * u + 4 * h + i];
              acc[i][h] = std::fma(static_cast<float>(isum) * (d * static_cast<float>(sm & 0x0F)), a, acc[i][h]);
              mins[i][h] = std::fma(f16(b + 8 + 2 * i) * static_cast<float>(sm >> 4), x.c16[xr * (in / 16) + 2 * sub + h],
                                    mins[i][h]);
            } else {
              const float sv = d * static_cast<float>(static_cast<int8_t>(b[8 + 8 * u + 4 * h + i]));
              acc[i][h] = std::fma(static_cast<float>(isum) * sv, a, acc[i][h]);
            }
          }
        } else if constexpr (T == kIQ4_XS) {  // signed values, a signed scale per 32 columns, no min
          int32_t isum = 0;
          for (int c = 0; c < 32; ++c) isum += w[c] * xq[c];
          const int h = u / 4;
          const float sv = d * static_cast<float>(static_cast<int8_t>(b[8 + 8 * (u % 4) + 4 * h + i]));
          acc[i][h] = std::fma(static_cast<float>(isum) * sv, a, acc[i][h]);
        } else {
          int32_t isum = 0;
          for (int c = 0; c < 32; ++c) isum += w[c] * xq[c];
          const int h = u / 4, at = 8 * (u % 4) + 4 * h + i;
          acc[i][h] = std::fma(static_cast<float>(isum) * (d * static_cast<float>(b[16 + at])), a, acc[i][h]);
          mins[i][h] = std::fma(f16(b + 8 + 2 * i) * static_cast<float>(b[48 + at]), x.c32[xr * in32 + sub], mins[i][h]);
        }
      }
    }
  }
  for (int i = 0; i < 4; ++i) out[i] = (acc[i][0] + acc[i][1]) - (mins[i][0] + mins[i][1]);
}

template <int T>
void tile_rows(const Segment& s, const BlockActs& x, float* y, int64_t out_total, int64_t r0, int64_t r1) {
  float out[4];
  for (int64_t t = r0 / 4; 4 * t < r1; ++t)
    for (int64_t k = 0; k < x.m; ++k) {
      if constexpr (k_tiled(T)) ktile_x4<T>(s.q + 4 * t * s.row_bytes, s.in / 256, x, k, out);
      else tile_x4<T>(s.q + 4 * t * s.row_bytes, s.in / 32, x, k, out);
      for (int64_t r = std::max(r0, 4 * t); r < std::min(r1, 4 * t + 4); ++r) y[k * out_total + s.first_row + r] = out[r - 4 * t];
    }
}

void dispatch(const Segment& s, const BlockActs& x, float* y, int64_t out_total, int64_t r0, int64_t r1) {
  if (is_tiled(s.type)) return visit_tiled(s.type, [&](auto t) { tile_rows<decltype(t)::value>(s, x, y, out_total, r0, r1); });
  visit_type(s.type, [&](auto t) { segment_rows<decltype(t)::value>(s, x, y, out_total, r0, r1); });
}

}  // namespace portable

#ifdef BRISK_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define BRISK_BLOCKS_VNNI 0
#include "cpu_blocks_simd.inc"
#undef BRISK_BLOCKS_VNNI
}  // namespace avx2
#pragma GCC pop_options

// AVX-VNNI (Alder Lake and later client cores, Zen 4 and 5): the avx2 body with vpdpbusd on the
// same 256-bit vectors instead of maddubs + madd + add: the same integers (no maddubs pair can
// saturate, see cpu_blocks_simd.inc), so the same bits.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace avxvnni {
#define BRISK_BLOCKS_VNNI 0
#define BRISK_BLOCKS_AVX_VNNI 1
#include "cpu_blocks_simd.inc"
#undef BRISK_BLOCKS_AVX_VNNI
#undef BRISK_BLOCKS_VNNI
}  // namespace avxvnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
namespace vnni {
#define BRISK_BLOCKS_VNNI 1
#include "cpu_blocks_simd.inc"
#undef BRISK_BLOCKS_VNNI
}  // namespace vnni
#pragma GCC pop_options
#endif

}  // namespace

bool supported(int type) {
  if (is_tiled(type)) return visit_tiled(type, [](auto) { return true; }, false);
  return visit_type(type, [](auto) { return true; }, false);
}

int64_t block_cols(int type) {
  return visit_type(file_type(type), [](auto t) { return int64_t{portable::Format<decltype(t)::value>::kCols}; },
                    int64_t{0});
}

int64_t block_bytes(int type) {
  if (is_tiled(type) && k_tiled(file_type(type))) return ktile_bytes(file_type(type)) / 4;
  return visit_type(file_type(type), [](auto t) { return int64_t{portable::Format<decltype(t)::value>::kBytes}; },
                    int64_t{0});
}

// Where a block of a tiled type (GGML type) keeps its fifth bits and its nibbles in the file:
// after d (and min), the 4 bytes of fifth bits, then the nibbles.
static int64_t file_high_at(int type) { return tile_mins(type) ? 4 : 2; }
static int64_t file_qs_at(int type) { return file_high_at(type) + tile_high(type) / 4; }

// A K-quant block of the file (row i of a tile) into its tile block `o` (blocks.h k_tiled), and back.
static void k_tile_block(int type, const uint8_t* b, int i, uint8_t* o) {
  const int64_t at = ktile_rest_at(type);
  std::memcpy(o + ktile_head(type) + i * ktile_rest(type), b + at, ktile_rest(type));
  if (type == kIQ4_XS) {  // Format<kIQ4_XS>::scales' 6-bit values, less 32
    std::memcpy(o + 2 * i, b, 2);
    const int high = b[2] | (b[3] << 8);
    for (int u = 0; u < 8; ++u) {
      const int low = (b[4 + u / 2] >> (4 * (u % 2))) & 0x0F;
      o[8 + 8 * (u % 4) + 4 * (u / 4) + i] = static_cast<uint8_t>(static_cast<int8_t>((low | (((high >> (2 * u)) & 3) << 4)) - 32));
    }
    return;
  }
  if (type == kQ2_K) {
    std::memcpy(o + 2 * i, b + 80, 2);
    std::memcpy(o + 8 + 2 * i, b + 82, 2);
    for (int u = 0; u < 16; ++u) o[16 + 8 * (u / 2) + 4 * (u % 2) + i] = b[u];
    return;
  }
  if (type == kQ3_K) {  // Format<kQ3_K>::scales' 6-bit values, less 32
    std::memcpy(o + 2 * i, b + 108, 2);
    const uint8_t* s = b + 96;
    for (int u = 0; u < 16; ++u) {
      const int low = u < 8 ? s[u] & 0x0F : s[u - 8] >> 4, high = (s[8 + u % 4] >> (2 * (u / 4))) & 3;
      o[8 + 8 * (u / 2) + 4 * (u % 2) + i] = static_cast<uint8_t>(static_cast<int8_t>((low | (high << 4)) - 32));
    }
    return;
  }
  if (type == kQ6_K) {
    std::memcpy(o + 2 * i, b + 208, 2);
    for (int u = 0; u < 16; ++u) o[8 + 8 * (u / 2) + 4 * (u % 2) + i] = b[192 + u];
    return;
  }
  std::memcpy(o + 2 * i, b, 2);
  std::memcpy(o + 8 + 2 * i, b + 2, 2);
  uint8_t sc[8], mn[8];
  portable::k_scales(b + 4, sc, mn);
  for (int u = 0; u < 8; ++u) o[16 + 8 * (u % 4) + 4 * (u / 4) + i] = sc[u], o[48 + 8 * (u % 4) + 4 * (u / 4) + i] = mn[u];
}

static void k_untile_block(int type, const uint8_t* o, int i, uint8_t* b) {
  std::memcpy(b + ktile_rest_at(type), o + ktile_head(type) + i * ktile_rest(type), ktile_rest(type));
  if (type == kIQ4_XS) {
    std::memcpy(b, o + 2 * i, 2);
    int high = 0;
    b[4] = b[5] = b[6] = b[7] = 0;
    for (int u = 0; u < 8; ++u) {
      const int v = static_cast<int8_t>(o[8 + 8 * (u % 4) + 4 * (u / 4) + i]) + 32;
      b[4 + u / 2] = static_cast<uint8_t>(b[4 + u / 2] | ((v & 0x0F) << (4 * (u % 2))));
      high |= ((v >> 4) & 3) << (2 * u);
    }
    b[2] = static_cast<uint8_t>(high & 0xFF), b[3] = static_cast<uint8_t>(high >> 8);
    return;
  }
  if (type == kQ2_K) {
    std::memcpy(b + 80, o + 2 * i, 2);
    std::memcpy(b + 82, o + 8 + 2 * i, 2);
    for (int u = 0; u < 16; ++u) b[u] = o[16 + 8 * (u / 2) + 4 * (u % 2) + i];
    return;
  }
  if (type == kQ3_K) {
    std::memcpy(b + 108, o + 2 * i, 2);
    uint8_t v[16];
    for (int u = 0; u < 16; ++u) v[u] = static_cast<uint8_t>(static_cast<int8_t>(o[8 + 8 * (u / 2) + 4 * (u % 2) + i]) + 32);
    uint8_t* s = b + 96;
    for (int u = 0; u < 8; ++u) s[u] = static_cast<uint8_t>((v[u] & 0x0F) | ((v[u + 8] & 0x0F) << 4));
    for (int k = 0; k < 4; ++k) {
      int high = 0;
      for (int g = 0; g < 4; ++g) high |= ((v[4 * g + k] >> 4) & 3) << (2 * g);
      s[8 + k] = static_cast<uint8_t>(high);
    }
    return;
  }
  if (type == kQ6_K) {
    std::memcpy(b + 208, o + 2 * i, 2);
    for (int u = 0; u < 16; ++u) b[192 + u] = o[8 + 8 * (u / 2) + 4 * (u % 2) + i];
    return;
  }
  std::memcpy(b, o + 2 * i, 2);
  std::memcpy(b + 2, o + 8 + 2 * i, 2);
  uint8_t sc[8], mn[8];
  for (int u = 0; u < 8; ++u) sc[u] = o[16 + 8 * (u % 4) + 4 * (u / 4) + i], mn[u] = o[48 + 8 * (u % 4) + 4 * (u / 4) + i];
  for (int j = 0; j < 4; ++j) {  // k_scales' packing: 6-bit values, the high 2 bits of 4-7 in bytes 0-7
    b[4 + j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
    b[8 + j] = static_cast<uint8_t>(mn[j] | ((mn[j + 4] >> 4) << 6));
    b[12 + j] = static_cast<uint8_t>((sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4));
  }
}

void tile_rows_of(int type, const uint8_t* src, uint8_t* dst, int64_t rows, int64_t nblocks) {
  const int64_t bytes = block_bytes(type), row_bytes = nblocks * bytes, high = tile_high(type), head = tile_head(type);
  if (k_tiled(type)) {
    const int64_t tile_row_bytes = nblocks * ktile_bytes(type) / 4;
    at::parallel_for(0, rows / 4, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t blk = 0; blk < nblocks; ++blk)
          for (int i = 0; i < 4; ++i)
            k_tile_block(type, src + (4 * t + i) * row_bytes + blk * bytes, i,
                         dst + 4 * t * tile_row_bytes + blk * ktile_bytes(type));
    });
    return;
  }
  at::parallel_for(0, rows / 4, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t blk = 0; blk < nblocks; ++blk) {
        uint8_t* o = dst + 4 * t * row_bytes + blk * 4 * bytes;
        std::memset(o + head, 0, high);
        for (int i = 0; i < 4; ++i) {
          const uint8_t* b = src + (4 * t + i) * row_bytes + blk * bytes;
          std::memcpy(o + 2 * i, b, 2);
          if (tile_mins(type)) std::memcpy(o + kTileMinsAt + 2 * i, b + 2, 2);
          std::memcpy(o + tile_nibbles(i, tile_qs(type)), b + file_qs_at(type), 16);
          if (!high) continue;
          uint32_t qh;
          std::memcpy(&qh, b + file_high_at(type), 4);
          for (int j = 0; j < 32; ++j) o[head + j % 16] |= static_cast<uint8_t>(((qh >> j) & 1) << tile_bit(i, j));
        }
      }
  });
}

void untile_row(int type, const uint8_t* tiles, int64_t row, int64_t nblocks, uint8_t* out) {
  const int64_t bytes = block_bytes(type), row_bytes = nblocks * bytes, high = tile_high(type), head = tile_head(type);
  const int i = static_cast<int>(row % 4);
  if (k_tiled(type)) {
    const int64_t tile_row_bytes = nblocks * ktile_bytes(type) / 4;
    for (int64_t blk = 0; blk < nblocks; ++blk)
      k_untile_block(type, tiles + (row / 4) * 4 * tile_row_bytes + blk * ktile_bytes(type), i, out + blk * bytes);
    return;
  }
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const uint8_t* p = tiles + (row / 4) * 4 * row_bytes + blk * 4 * bytes;
    uint8_t* b = out + blk * bytes;
    std::memcpy(b, p + 2 * i, 2);
    if (tile_mins(type)) std::memcpy(b + 2, p + kTileMinsAt + 2 * i, 2);
    std::memcpy(b + file_qs_at(type), p + tile_nibbles(i, tile_qs(type)), 16);
    if (!high) continue;
    uint32_t qh = 0;
    for (int j = 0; j < 32; ++j) qh |= static_cast<uint32_t>((p[head + j % 16] >> tile_bit(i, j)) & 1) << j;
    std::memcpy(b + file_high_at(type), &qh, 4);
  }
}

// Plain C++ on every ISA: the rounding (x / a, to nearest even) is quant/grouped.py's
// quantize_act_blocks(x, "int8"), which the tests use as the reference.
namespace {

#ifdef BRISK_X86
// quantize_acts' 32-column blocks 16 lanes at a time: the same integers (IEEE division, round half
// to even, the same clamp) and the same scalar float products for the sums. A decode step
// quantizes every Linear's input on each thread; the scalar loop was ~0.4 ms of a Gemma 3 token.
__attribute__((target("avx512f"))) void quantize_block_avx512(const float* xb, int8_t* q, uint8_t* qu, float& a,
                                                            int32_t (&sums)[2]) {
  const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
  a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1))) / 127.0f;
  __m512i q0 = _mm512_setzero_si512(), q1 = _mm512_setzero_si512();
  if (a > 0.0f) {
    const __m512 d = _mm512_set1_ps(a);
    q0 = brisk_simd::round_clamp(_mm512_div_ps(v0, d), 127);
    q1 = brisk_simd::round_clamp(_mm512_div_ps(v1, d), 127);
  }
  const __m512i off = _mm512_set1_epi32(128);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qu), _mm512_cvtepi32_epi8(_mm512_add_epi32(q0, off)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qu + 16), _mm512_cvtepi32_epi8(_mm512_add_epi32(q1, off)));
  sums[0] = _mm512_reduce_add_epi32(q0), sums[1] = _mm512_reduce_add_epi32(q1);
}

__attribute__((target("avx2"))) inline int32_t sum16_avx2(__m256i x, __m256i y) {  // all 16 int32 lanes
  return brisk_simd::hsum_epi32(_mm256_add_epi32(x, y));
}

// max |x| over n floats (n a multiple of 8): the activations' scale before the / 127.
__attribute__((target("avx2,fma"))) float amax_avx2(const float* x, int n) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}

// 32 floats as int8 q = clamp(round-half-even(x / a)) into q (0 where a is 0), and their int32s in
// c: quantize_block's integers (IEEE division), shared with the prompt kernel's 128-column runs.
__attribute__((target("avx2,fma"))) void round32_avx2(const float* xb, float a, int8_t* q, __m256i (&c)[4]) {
  for (int i = 0; i < 4; ++i) c[i] = _mm256_setzero_si256();
  if (a > 0.0f) {
    const __m256 d = _mm256_set1_ps(a), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(xb + 8 * i), d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      c[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    }
  }
  // int32 x 32 -> int8 x 32 in order: the packs interleave 128-bit lanes, the permute undoes it
  const __m256i p = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p);
}

// The same at AVX2: on an AVX2 Zen 3 the scalar loop cost ~4.8 ns a column, ~0.45 ms of a Q4_K_M
// decode step (each thread quantizes every block Linear's input).
__attribute__((target("avx2,fma"))) void quantize_block_avx2(const float* xb, int8_t* q, uint8_t* qu, float& a,
                                                           int32_t (&sums)[2]) {
  a = amax_avx2(xb, 32) / 127.0f;
  __m256i c[4];
  round32_avx2(xb, a, q, c);
  const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qu), _mm256_xor_si256(p, _mm256_set1_epi8(static_cast<char>(0x80))));
  sums[0] = sum16_avx2(c[0], c[1]), sums[1] = sum16_avx2(c[2], c[3]);
}
#endif

// One 32-column block: a = max |x| / 127, q = clamp(round(x / a)), q + 128, the halves' sums.
void quantize_block(const float* xb, int8_t* q, uint8_t* qu, float& a, int32_t (&sums)[2]) {
#ifdef BRISK_X86
  if (brisk_isa::avx512()) return quantize_block_avx512(xb, q, qu, a, sums);
  if (brisk_isa::at_least_avx2()) return quantize_block_avx2(xb, q, qu, a, sums);
#endif
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
  a = amax / 127.0f;
  sums[0] = sums[1] = 0;
  for (int i = 0; i < 32; ++i) {
    const int v = a > 0.0f ? static_cast<int>(std::nearbyint(xb[i] / a)) : 0;
    q[i] = static_cast<int8_t>(std::clamp(v, -127, 127));
    qu[i] = static_cast<uint8_t>(q[i] + 128);
    sums[i / 16] += q[i];
  }
}

#include "cpu_blocks_prompt.inc"

}  // namespace

void quantize_acts(const float* x, int64_t m, int64_t in, BlockActs& out) {
  out.m = m, out.in = in;
  out.q.resize(m * in), out.qu.resize(m * in), out.a.resize(m * in / 32), out.a8.resize(m * in / 4);
  out.c16.resize(m * in / 16), out.c32.resize(m * in / 32);
  for (auto& z : out.zsum) z.resize(m * in / 4);
  for (auto& z : out.zpair) z.resize(m * in / 16);
  for (int64_t k = 0; k < m; ++k)
    for (int64_t b = 0; b < in / 32; ++b) {
      float a;
      int32_t sums[2];
      quantize_block(x + k * in + 32 * b, out.q.data() + k * in + 32 * b, out.qu.data() + k * in + 32 * b, a, sums);
      out.a[k * (in / 32) + b] = a;
      for (int l = 0; l < 8; ++l) out.a8[(k * (in / 32) + b) * 8 + l] = a;
      out.c16[k * (in / 16) + 2 * b] = a * static_cast<float>(sums[0]);
      out.c16[k * (in / 16) + 2 * b + 1] = a * static_cast<float>(sums[1]);
      out.c32[k * (in / 32) + b] = a * static_cast<float>(sums[0] + sums[1]);
      const int8_t* q = out.q.data() + k * in + 32 * b;
      int32_t pair[2] = {0, 0};
      for (int l = 0; l < 8; ++l) {
        const int32_t lane = q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3];
        for (int z = 0; z < 4; ++z) out.zsum[z][(k * in + 32 * b) / 4 + l] = -kZeroPoints[z] * lane;
        pair[(l >> 1) & 1] += lane;  // lanes 0, 1, 4, 5: columns 0-7 and 16-23
      }
      for (int z = 0; z < 4; ++z)
        for (int h = 0; h < 2; ++h) out.zpair[z][(k * (in / 32) + b) * 2 + h] = -kZeroPoints[z] * pair[h];
    }
}

void rows(const std::vector<Segment>& segs, const BlockActs& x, float* y, int64_t out_total, int64_t r0, int64_t r1) {
  for (const Segment& s : segs) {
    const int64_t lo = std::max(r0, s.first_row) - s.first_row, hi = std::min(r1, s.first_row + s.out) - s.first_row;
    if (lo >= hi) continue;
#ifdef BRISK_X86
    if (brisk_isa::vnni()) {
      vnni::dispatch(s, x, y, out_total, lo, hi);
      continue;
    }
    if (brisk_isa::avx_vnni()) {
      avxvnni::dispatch(s, x, y, out_total, lo, hi);
      continue;
    }
    if (brisk_isa::active() != brisk_isa::Level::kScalar) {
      avx2::dispatch(s, x, y, out_total, lo, hi);
      continue;
    }
#endif
    portable::dispatch(s, x, y, out_total, lo, hi);
  }
}

}  // namespace brisk_blocks

// ---- Python entry points ------------------------------------------------------------------

namespace {

std::vector<brisk_blocks::Segment> check_segments(const std::vector<torch::Tensor>& blocks,
                                                  const std::vector<int64_t>& types, int64_t in) {
  TORCH_CHECK(!blocks.empty() && blocks.size() == types.size(), "brisk block_gemm: one type per weight segment");
  std::vector<brisk_blocks::Segment> segs;
  int64_t first = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const torch::Tensor& b = blocks[i];
    const int type = static_cast<int>(types[i]);
    TORCH_CHECK(brisk_blocks::supported(type), "brisk block_gemm: GGML type ", type, " has no block kernel");
    TORCH_CHECK(b.dim() == 2 && b.scalar_type() == torch::kUInt8 && b.is_contiguous() && b.device().is_cpu(),
                "brisk block_gemm: weight blocks must be contiguous uint8 CPU tensors [out, row bytes]");
    const int64_t cols = brisk_blocks::block_cols(type);
    TORCH_CHECK(!brisk_blocks::is_tiled(type) || b.size(0) % 4 == 0,
                "brisk block_gemm: a tiled weight (type ", type, ") has a multiple of 4 rows, got ", b.size(0));
    TORCH_CHECK(in % cols == 0 && b.size(1) == in / cols * brisk_blocks::block_bytes(type),
                "brisk block_gemm: a row of ", in, " columns in type ", type, " takes ",
                in % cols == 0 ? in / cols * brisk_blocks::block_bytes(type) : -1, " bytes, got ", b.size(1));
    segs.push_back({b.data_ptr<uint8_t>(), type, b.size(0), in, b.size(1), first});
    first += b.size(0);
  }
  return segs;
}

}  // namespace

// y [M, out] = quantize_act_blocks(x, "int8") @ W^T (+ bias), W the row-stacked segments, each
// in its GGML type's blocks as the file stores them.
torch::Tensor block_gemm(const torch::Tensor& x, const std::vector<torch::Tensor>& blocks,
                         const std::vector<int64_t>& types, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "brisk block_gemm: x must be a 2-D CPU tensor");
  const int64_t m = x.size(0), in = x.size(1);
  TORCH_CHECK(in % 32 == 0, "brisk block_gemm: input width ", in, " is not a multiple of 32");
  const auto segs = check_segments(blocks, types, in);
  const int64_t out = segs.back().first_row + segs.back().out;
  auto xf = x.to(torch::kFloat32).contiguous();
  auto y = torch::empty({m, out}, x.options().dtype(torch::kFloat32));
  thread_local brisk_blocks::BlockActs scratch;
  brisk_blocks::BlockActs& acts = scratch;  // the pool's threads read the caller's
  brisk_blocks::quantize_acts(xf.data_ptr<float>(), m, in, acts);
  float* yp = y.data_ptr<float>();
  const int64_t unit = brisk_range::kRowUnit;
  at::parallel_for(0, (out + unit - 1) / unit, 4, [&](int64_t u0, int64_t u1) {
    brisk_blocks::rows(segs, acts, yp, out, u0 * unit, std::min(out, u1 * unit));
  });
  if (bias.has_value()) y.add_(bias->to(torch::kFloat32));
  return y;
}

// y[:, first_rows[i] + r] = x @ W_i^T for the K-quant tile segments W_i (Q2_K ... Q6_K, tiled):
// cpu_blocks_prompt.inc, x quantized per 128 columns (batched prompt work; y's other columns untouched).
void block_kgemm(const torch::Tensor& x, const std::vector<torch::Tensor>& blocks, const std::vector<int64_t>& types,
                 const std::vector<int64_t>& first_rows, const torch::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "brisk block_kgemm: x must be a 2-D CPU tensor");
  const int64_t m = x.size(0), in = x.size(1);
  TORCH_CHECK(in % 256 == 0, "brisk block_kgemm: input width ", in, " is not a multiple of 256");
  TORCH_CHECK(y.dim() == 2 && y.size(0) == m && y.scalar_type() == torch::kFloat32 && y.is_contiguous() && y.device().is_cpu(),
              "brisk block_kgemm: y must be a contiguous float32 CPU tensor [M, out]");
  TORCH_CHECK(first_rows.size() == blocks.size(), "brisk block_kgemm: one first row per segment");
  auto segs = check_segments(blocks, types, in);
  for (size_t i = 0; i < segs.size(); ++i) {
    TORCH_CHECK(brisk_blocks::is_tiled(segs[i].type) && brisk_blocks::kgemm_type(brisk_blocks::file_type(segs[i].type)),
                "brisk block_kgemm: type ", segs[i].type, " is no K-quant tile (TILED | Q2_K ... Q6_K)");
    TORCH_CHECK(first_rows[i] >= 0 && first_rows[i] + segs[i].out <= y.size(1), "brisk block_kgemm: segment ", i,
                " does not fit y's columns");
    segs[i].first_row = first_rows[i];
  }
  auto xf = x.to(torch::kFloat32).contiguous();
  thread_local brisk_blocks::KActs scratch;
  brisk_blocks::KActs& acts = scratch;
  brisk_blocks::quantize_kacts(xf.data_ptr<float>(), m, in, acts);
  float* yp = y.data_ptr<float>();
  const int64_t out = y.size(1);
  for (const auto& s : segs)
    at::parallel_for(0, s.out / 4, 8, [&](int64_t t0, int64_t t1) { brisk_blocks::kgemm_rows(s, acts, yp, out, t0, t1); });
}

// Rows [r0, r1) of one segment's weight as float32 [r1 - r0, in]: w = d q - m, the values the
// kernels' integer sums stand for (batched prompt work multiplies them in a float GEMM a tile at a
// time). AVX2 or better: the portable build has no such path (brisk.kernels checks).
torch::Tensor block_dequantize(const torch::Tensor& blocks, int64_t type, int64_t in, int64_t r0, int64_t r1) {
  const auto segs = check_segments({blocks}, {type}, in);
  TORCH_CHECK(0 <= r0 && r0 <= r1 && r1 <= blocks.size(0), "brisk block_dequantize: rows out of range");
  auto out = torch::empty({r1 - r0, in}, torch::dtype(torch::kFloat32));
#ifdef BRISK_X86
  TORCH_CHECK(brisk_isa::active() != brisk_isa::Level::kScalar, "brisk block_dequantize: needs AVX2");
  float* o = out.data_ptr<float>();
  at::parallel_for(r0, r1, 16, [&](int64_t a, int64_t b) { brisk_blocks::avx2::dequant_rows(segs[0], o + (a - r0) * in, a, b); });
#else
  TORCH_CHECK(false, "brisk block_dequantize: needs an x86-64 CPU with AVX2");
#endif
  return out;
}

#ifdef BRISK_X86
namespace {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
// n floats as bfloat16 (n % 16 == 0), rounded as torch rounds (c10::BFloat16: to nearest even, a NaN
// to 0x7FC0), so the bits equal `.bfloat16()` of the float32 rows.
void to_bf16_avx2(const float* src, uint16_t* dst, int64_t n) {
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1), nan = _mm256_set1_epi32(0x7FC0);
  for (int64_t i = 0; i < n; i += 16) {
    __m256i h[2];
    for (int k = 0; k < 2; ++k) {
      const __m256 v = _mm256_loadu_ps(src + i + 8 * k);
      const __m256i u = _mm256_castps_si256(v);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
      const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias, lsb)), 16);
      h[k] = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    }
    // packus interleaves 128-bit lanes: [h0 lo, h1 lo, h0 hi, h1 hi] -> in order
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h[0], h[1]), _MM_SHUFFLE(3, 1, 2, 0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), packed);
  }
}
#pragma GCC pop_options
}  // namespace
#endif

// Rows [r0, r1) of one segment's weight as bfloat16 into out [r1 - r0, in] (contiguous): the same
// values as block_dequantize's float32 rounded as torch rounds, without the float32 matrix (each
// thread decodes four rows into a scratch row set and rounds them). Prompt work on a CPU whose
// AMX-BF16 tiles run torch's bf16 GEMMs (quant/gguf.py).
void block_dequantize_bf16(const torch::Tensor& blocks, int64_t type, int64_t in, int64_t r0, int64_t r1,
                           const torch::Tensor& out) {
  const auto segs = check_segments({blocks}, {type}, in);
  TORCH_CHECK(0 <= r0 && r0 <= r1 && r1 <= blocks.size(0), "brisk block_dequantize_bf16: rows out of range");
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 && out.is_contiguous() && out.device().is_cpu() && out.dim() == 2 &&
                  out.size(0) == r1 - r0 && out.size(1) == in,
              "brisk block_dequantize_bf16: out must be a contiguous bfloat16 CPU tensor [r1 - r0, in]");
  TORCH_CHECK(in % 16 == 0, "brisk block_dequantize_bf16: input width ", in, " is not a multiple of 16");
#ifdef BRISK_X86
  TORCH_CHECK(brisk_isa::active() != brisk_isa::Level::kScalar, "brisk block_dequantize_bf16: needs AVX2");
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  // units of four rows from a multiple of 4, so a thread decodes whole tiles of a tiled type
  const int64_t u0 = r0 / 4, u1 = (r1 + 3) / 4;
  at::parallel_for(u0, u1, 4, [&](int64_t a, int64_t b) {
    std::vector<float> scratch(static_cast<size_t>(4 * in));
    for (int64_t u = a; u < b; ++u) {
      const int64_t ra = std::max(r0, 4 * u), rb = std::min(r1, 4 * u + 4);
      brisk_blocks::avx2::dequant_rows(segs[0], scratch.data(), ra, rb);
      to_bf16_avx2(scratch.data(), o + (ra - r0) * in, (rb - ra) * in);
    }
  });
#else
  TORCH_CHECK(false, "brisk block_dequantize_bf16: needs an x86-64 CPU with AVX2");
#endif
}

// Blocks of a type with tiles [rows, row bytes] (rows % 4 == 0) in that type's tiled layout (blocks.h
// kTiled): four rows interleaved block by block for the tile kernel, the same bytes (Q3_K / Q4_K /
// Q5_K: their scales unpacked, 4 bytes more a row's block). Into `out` when given (rows of a larger
// tiled weight: a loader tiles a file tensor a chunk of rows at a time, quant/gguf.py).
torch::Tensor block_tile(const torch::Tensor& blocks, int64_t type, const std::optional<torch::Tensor>& out) {
  TORCH_CHECK(brisk_blocks::supported(brisk_blocks::kTiled | static_cast<int>(type)),
              "brisk block_tile: only Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), IQ4_NL (20), IQ4_XS (23) and Q2_K to Q6_K (10-14) have a tiled layout, got ", type);
  const int64_t bytes = brisk_blocks::block_bytes(static_cast<int>(type));
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == torch::kUInt8 && blocks.device().is_cpu() &&
                  blocks.size(0) % 4 == 0 && blocks.size(1) % bytes == 0,
              "brisk block_tile: blocks must be uint8 CPU [rows, row bytes] with rows % 4 == 0");
  const auto src = blocks.contiguous();
  const int64_t nblocks = src.size(1) / bytes;
  const int64_t cols = nblocks * brisk_blocks::block_bytes(brisk_blocks::kTiled | static_cast<int>(type));
  if (out.has_value())
    TORCH_CHECK(out->dim() == 2 && out->scalar_type() == torch::kUInt8 && out->device().is_cpu() &&
                    out->is_contiguous() && out->size(0) == src.size(0) && out->size(1) == cols,
                "brisk block_tile: out must be a contiguous uint8 CPU tensor [", src.size(0), ", ", cols, "]");
  auto dst = out.has_value() ? *out : torch::empty({src.size(0), cols}, src.options());
  brisk_blocks::tile_rows_of(static_cast<int>(type), src.data_ptr<uint8_t>(), dst.data_ptr<uint8_t>(), src.size(0),
                             src.size(1) / bytes);
  return dst;
}

// The file's rows of a tiled weight (block_tile's inverse).
torch::Tensor block_untile(const torch::Tensor& tiles, int64_t type) {
  TORCH_CHECK(brisk_blocks::is_tiled(static_cast<int>(type)) && brisk_blocks::supported(static_cast<int>(type)),
              "brisk block_untile: type ", type, " is not a tiled type");
  const int file = brisk_blocks::file_type(static_cast<int>(type));
  const int64_t bytes = brisk_blocks::block_bytes(static_cast<int>(type)), file_bytes = brisk_blocks::block_bytes(file);
  TORCH_CHECK(tiles.dim() == 2 && tiles.scalar_type() == torch::kUInt8 && tiles.device().is_cpu() &&
                  tiles.size(0) % 4 == 0 && tiles.size(1) % bytes == 0,
              "brisk block_untile: tiles must be uint8 CPU [rows, row bytes] with rows % 4 == 0");
  const auto src = tiles.contiguous();
  const int64_t nblocks = src.size(1) / bytes;
  auto out = torch::empty({src.size(0), nblocks * file_bytes}, src.options());
  at::parallel_for(0, src.size(0), 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      brisk_blocks::untile_row(file, src.data_ptr<uint8_t>(), r, nblocks, out.data_ptr<uint8_t>() + r * out.size(1));
  });
  return out;
}
