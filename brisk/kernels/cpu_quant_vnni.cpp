// Group-quantized weights (cpu_quant.cpp's layout, row-major or tiled) times activations quantized
// to int8 (or int16: a16_tile below, and int16_tile8 for 8-bit weights) in blocks of 32 columns, as llama.cpp
// multiplies its Q4_1 weights by Q8_1 activations:
// the weight nibbles (or the int8 weights + 128) meet the int8 activations in AVX512-VNNI's
// vpdpbusd, 64 multiply-adds an instruction with no per-weight conversion to float. The float
// kernel spends ~6 vector instructions on every 32 weights (nibble -> table lookup -> fma); this
// one ~6 on every 128, so decode is bound by reading the weights, not by unpacking them.
//
// Activations, per row and block b of 32 columns: a_b = max |x| / 127, q = round-half-even(x / a_b)
// (IEEE division: the integers torch.round(x / a) gives, quant/grouped.py quantize_act_blocks).
// With w = q_w s + z (4-bit) or q_w s (8-bit) per group g of the weight row:
//   y = sum_g ( s_g * sum_{b in g} a_b * D_b  +  z'_g * C_g )
//   D_b = sum over the block of u_w q_x (int32, exact);  C_g = sum_{b in g} a_b * sum_b(q_x)
//   4-bit: u_w = q_w, z' = z;   8-bit: u_w = q_w + 128 (vpdpbusd's unsigned operand), z' = -128 s
//   (the + 128 terms cancel in float32: a few ulps more rounding than a signed product would have).
// Every (x row, weight row) pair is summed in the same order whatever the batch: batch invariant.
// Three paths compute the same integers and the same float operations per lane, so their results
// are bit-identical: AVX512-VNNI (below), AVX2 (vpmaddubsw / vpmaddwd on 256-bit halves of a tile)
// and a portable loop (any CPU).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "group_weights.h"
#include "kernels.h"
#include "simd.h"

namespace {

constexpr int64_t kBlock = 32;  // activation columns per int8 scale; also one weight run

using brisk_group::GroupWeights;

template <typename T>
struct ActsT {
  const T* q;       // [M, in] (int16: permuted per block, see a16_tile)
  const float* a;   // [M, in / 32] block scales
  const float* c;   // [M, groups]  sum_{b in g} a_b * sum_b(q)
  int64_t in, blocks, groups;
};
using Acts = ActsT<int8_t>;
using Acts16 = ActsT<int16_t>;

#ifdef BRISK_X86
// One row of activations -> int8 (Levels 127) or int16 (32767) blocks, their scales and the
// per-group sums C_g. int16 blocks are stored in a16_tile's permuted column order.
template <typename T, int Levels>
__attribute__((target("avx512f,avx512bw"))) void quantize_act_row(const float* x, const GroupWeights& w, T* q,
                                                                  float* a, float* c) {
  const int64_t per_group = w.group / kBlock;
  for (int64_t g = 0; g < w.groups; ++g) {
    float cg = 0.0f;
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      const __m512 v0 = _mm512_loadu_ps(x + b * kBlock), v1 = _mm512_loadu_ps(x + b * kBlock + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float ab = amax / static_cast<float>(Levels);
      __m512i q0 = _mm512_setzero_si512(), q1 = _mm512_setzero_si512();
      if (ab > 0.0f) {
        const __m512 d = _mm512_set1_ps(ab);
        q0 = brisk_simd::round_clamp(_mm512_div_ps(v0, d), Levels);
        q1 = brisk_simd::round_clamp(_mm512_div_ps(v1, d), Levels);
      }
      T* qb = q + b * kBlock;
      if constexpr (sizeof(T) == 1) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtepi32_epi8(q1));
      } else {
        alignas(64) int32_t v[kBlock];
        _mm512_store_si512(v, q0);
        _mm512_store_si512(v + 16, q1);
        for (int e = 0; e < 4; ++e)
          for (int m = 0; m < 8; ++m) qb[8 * e + m] = static_cast<T>(v[2 * m + e / 2 + 16 * (e % 2)]);
      }
      a[b] = ab;
      cg = std::fma(ab, static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1))), cg);  // one rounding, on every path
    }
    c[g] = cg;
  }
}

// The bytes of 4 weight rows' run c, row j in the j-th quarter (4-bit: 16 bytes) or half of the
// j/2-th vector (8-bit: 32 bytes). Tiled weights are one contiguous load; row-major ones and the
// last rows of an odd-sized matrix are gathered (missing rows read as zeros and are not stored).
template <int Bits>
__attribute__((target("avx512f"))) inline void load_rows(const GroupWeights& w, int64_t r, int64_t c, int nrows,
                                                        __m512i (&v)[Bits == 4 ? 1 : 2]) {
  constexpr int kVecs = Bits == 4 ? 1 : 2;
  if (w.tiled) {
    const uint8_t* p = w.run(r, c);
    for (int i = 0; i < kVecs; ++i) v[i] = _mm512_loadu_si512(p + 64 * i);
    return;
  }
  alignas(64) uint8_t buf[64 * kVecs] = {};
  for (int j = 0; j < nrows; ++j) std::memcpy(buf + j * w.run_bytes, w.run(r + j, c), w.run_bytes);
  for (int i = 0; i < kVecs; ++i) v[i] = _mm512_load_si512(buf + 64 * i);
}

// The 4 rows' scales and offsets (z': 4-bit zero, 8-bit -128 scale) of group g as floats. Tiled:
// one 8-byte load each; row-major: gathered in registers (scalar stores read back as one vector
// would stall store forwarding).
template <int Bits>
__attribute__((target("f16c"))) inline void group_params(const GroupWeights& w, int64_t r, int64_t g,
                                                                int nrows, __m128& s4, __m128& z4) {
  if (w.tiled) {
    const int64_t at = w.at(r, g);
    s4 = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.scale + at)));
    z4 = Bits == 4 ? _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.zero + at)))
                   : _mm_mul_ps(s4, _mm_set1_ps(-128.0f));
    return;
  }
  float s[4] = {0.0f, 0.0f, 0.0f, 0.0f}, z[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int j = 0; j < nrows; ++j) {
    s[j] = _cvtsh_ss(w.scale[w.at(r + j, g)]);
    z[j] = Bits == 4 ? _cvtsh_ss(w.zero[w.at(r + j, g)]) : -128.0f * s[j];
  }
  s4 = _mm_setr_ps(s[0], s[1], s[2], s[3]);
  z4 = _mm_setr_ps(z[0], z[1], z[2], z[3]);
}

// Each of the 4 rows' lanes summed: [row 0, row 1, row 2, row 3], in a fixed order.
template <int Vecs>
__attribute__((target("avx512f"))) inline __m128 row_sums(const __m512 (&acc)[Vecs]) {
  __m128 r[4];
  if constexpr (Vecs == 1) {  // 4 lanes a row: row j is 128-bit quarter j
    for (int j = 0; j < 4; ++j) r[j] = _mm512_extractf32x4_ps(acc[0], j);
  } else {  // 8 lanes a row: rows 2 i and 2 i + 1 are the halves of vector i
    r[0] = _mm_add_ps(_mm512_extractf32x4_ps(acc[0], 0), _mm512_extractf32x4_ps(acc[0], 1));
    r[1] = _mm_add_ps(_mm512_extractf32x4_ps(acc[0], 2), _mm512_extractf32x4_ps(acc[0], 3));
    r[2] = _mm_add_ps(_mm512_extractf32x4_ps(acc[1], 0), _mm512_extractf32x4_ps(acc[1], 1));
    r[3] = _mm_add_ps(_mm512_extractf32x4_ps(acc[1], 2), _mm512_extractf32x4_ps(acc[1], 3));
  }
  return _mm_hadd_ps(_mm_hadd_ps(r[0], r[1]), _mm_hadd_ps(r[2], r[3]));
}

// Which of a tile's 4 rows each int32 lane holds: 4 lanes a row (4-bit, one vector), 8 (8-bit, two).
template <int Lanes>
alignas(64) constexpr int32_t kRowOfLane[2][16] = {
    {0 / Lanes, 1 / Lanes, 2 / Lanes, 3 / Lanes, 4 / Lanes, 5 / Lanes, 6 / Lanes, 7 / Lanes, 8 / Lanes, 9 / Lanes,
     10 / Lanes, 11 / Lanes, 12 / Lanes, 13 / Lanes, 14 / Lanes, 15 / Lanes},
    {16 / Lanes, 17 / Lanes, 18 / Lanes, 19 / Lanes, 20 / Lanes, 21 / Lanes, 22 / Lanes, 23 / Lanes, 24 / Lanes,
     25 / Lanes, 26 / Lanes, 27 / Lanes, 28 / Lanes, 29 / Lanes, 30 / Lanes, 31 / Lanes}};

// y rows [m0, m0 + MB) x weight rows [r, r + nrows), nrows <= 4. Per x row: `gacc` sums a group's
// blocks (a_b * D_b as floats), `acc` the groups times their scale, `zacc` the offset terms.
template <int Bits, int MB>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c,fma"))) void vnni_tile(const GroupWeights& w, const Acts& x,
                                                                           float* y, int64_t m0, int64_t r, int nrows) {
  constexpr int kVecs = Bits == 4 ? 1 : 2;
  constexpr int kLanes = 16 * kVecs / 4;  // int32 lanes each weight row's partial sums occupy
  const __m512i nibble = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t per_group = w.group / kBlock;
  const int64_t ahead = w.tiled ? 1024 : 0;  // the tiled stream 1 KB on comes from DRAM: ask now
  __m512 acc[MB][kVecs];
  __m128 zacc[MB];
  for (int k = 0; k < MB; ++k) {
    zacc[k] = _mm_setzero_ps();
    for (int i = 0; i < kVecs; ++i) acc[k][i] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < w.groups; ++g) {
    __m128 s4, z4;  // the 4 rows' scales and offsets for this group
    group_params<Bits>(w, r, g, nrows, s4, z4);
    __m512 svec[kVecs];  // each scale spread over its row's lanes
    for (int i = 0; i < kVecs; ++i)
      svec[i] = _mm512_permutexvar_ps(_mm512_loadu_si512(kRowOfLane<kLanes>[i]), _mm512_castps128_ps512(s4));
    __m512 gacc[MB][kVecs];
    for (int k = 0; k < MB; ++k)
      for (int i = 0; i < kVecs; ++i) gacc[k][i] = _mm512_setzero_ps();
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(w.run(r, b)) + ahead, _MM_HINT_T0);
      __m512i v[kVecs];
      load_rows<Bits>(w, r, b, nrows, v);
      __m512i lo, hi;
      if constexpr (Bits == 4) {
        lo = _mm512_and_si512(v[0], nibble);                         // columns 0..15 of each row
        hi = _mm512_and_si512(_mm512_srli_epi16(v[0], 4), nibble);  // columns 16..31
      } else {
        lo = _mm512_xor_si512(v[0], flip);  // rows 0, 1: q + 128 as unsigned bytes
        hi = _mm512_xor_si512(v[1], flip);  // rows 2, 3
      }
      for (int k = 0; k < MB; ++k) {
        const int8_t* xq = x.q + (m0 + k) * x.in + b * kBlock;
        const __m512 ab = _mm512_set1_ps(x.a[(m0 + k) * x.blocks + b]);
        __m512i d[kVecs];
        if constexpr (Bits == 4) {
          const __m512i xlo = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq)));
          const __m512i xhi = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + 16)));
          d[0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo), hi, xhi);
        } else {
          const __m512i xb = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
          d[0] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xb);
          d[1] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, xb);
        }
        for (int i = 0; i < kVecs; ++i) gacc[k][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[i]), ab, gacc[k][i]);
      }
    }
    for (int k = 0; k < MB; ++k) {
      for (int i = 0; i < kVecs; ++i) acc[k][i] = _mm512_fmadd_ps(gacc[k][i], svec[i], acc[k][i]);
      zacc[k] = _mm_fmadd_ps(z4, _mm_set1_ps(x.c[(m0 + k) * x.groups + g]), zacc[k]);
    }
  }
  for (int k = 0; k < MB; ++k) {
    alignas(16) float t[4];
    _mm_store_ps(t, _mm_add_ps(row_sums<kVecs>(acc[k]), zacc[k]));
    for (int j = 0; j < nrows; ++j) y[(m0 + k) * w.out + r + j] = t[j];
  }
}

// Tiles [t0, t1) of 4 weight rows: every block of x rows runs over a tile while it is in L1, so
// the weights are read from memory once whatever the batch. `Kernel::tile<MB>` is one
// tile's kernel for MB rows of x (vnni_tile, a16_tile); MB = 8 where `Kernel::kWide` (a kernel
// whose accumulators are one register an x row).
template <typename Kernel>
constexpr bool kPairs = false;  // Kernel::pair<MB> runs two whole tiles (8 rows) at once

template <typename Kernel, typename A>
void tile_range(const GroupWeights& w, const A& x, float* y, int64_t m_rows, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t r = 4 * t;
    if constexpr (kPairs<Kernel>) {
      if (t + 1 < t1 && r + 8 <= w.out) {
        int64_t m0 = 0;
        for (; m0 + 8 <= m_rows; m0 += 8) Kernel::template pair<8>(w, x, y, m0, r);
        for (; m0 + 4 <= m_rows; m0 += 4) Kernel::template pair<4>(w, x, y, m0, r);
        for (; m0 + 3 <= m_rows; m0 += 3) Kernel::template pair<3>(w, x, y, m0, r);
        for (; m0 + 2 <= m_rows; m0 += 2) Kernel::template pair<2>(w, x, y, m0, r);
        for (; m0 < m_rows; ++m0) Kernel::template pair<1>(w, x, y, m0, r);
        ++t;
        continue;
      }
    }
    const int nrows = static_cast<int>(std::min<int64_t>(4, w.out - r));
    int64_t m0 = 0;
    if constexpr (Kernel::kWide) for (; m0 + 8 <= m_rows; m0 += 8) Kernel::template tile<8>(w, x, y, m0, r, nrows);
    for (; m0 + 4 <= m_rows; m0 += 4) Kernel::template tile<4>(w, x, y, m0, r, nrows);
    // 3 rows in one pass (a speculative step verifying 2 drafts): as 2 + 1 the tile was unpacked
    // twice and the third row cost 2.2x the second (the default model's 90 int16-activation
    // Linears: 1 / 2 / 3 rows 3.7 / 4.4 / 7.4 ms, now 3 rows 5.1-5.2 ms)
    for (; m0 + 3 <= m_rows; m0 += 3) Kernel::template tile<3>(w, x, y, m0, r, nrows);
    for (; m0 + 2 <= m_rows; m0 += 2) Kernel::template tile<2>(w, x, y, m0, r, nrows);
    for (; m0 < m_rows; ++m0) Kernel::template tile<1>(w, x, y, m0, r, nrows);
  }
}

template <int Bits>
struct VnniKernel {
  static constexpr bool kWide = false;
  template <int MB>
  static void tile(const GroupWeights& w, const Acts& x, float* y, int64_t m0, int64_t r, int nrows) {
    vnni_tile<Bits, MB>(w, x, y, m0, r, nrows);
  }
};

// ---- 4-bit weights x int16 activations ---------------------------------------------------------
// Per row and 32-column block: a_b = max |x| / 32767, q = round-half-even(x / a_b), ~1e-5 of the
// block's largest value: a rounding far below the weights' (quant/grouped.py quantize_act_blocks
// with 16 bits). vpdpwssd multiplies 32 int16 pairs an instruction, so a 4-row tile's 128 weights
// take ~15 vector instructions against the float kernel's ~24 (nibble -> table -> fma), which on
// this CPU were the limit (~17 GB/s), not memory.
//
// A tile's 64 bytes as 32 int16 lanes: lane 8 j + m holds row j's bytes 2 m, 2 m + 1, so its
// 4-bit field e (e = 0..3) is column 2 m + e / 2 + 16 (e % 2). Each int32 lane of vpdpwssd sums
// two int16 lanes of one row. The activations are stored permuted to match: per block and e, the
// 8 columns 2 m + e / 2 + 16 (e % 2), m = 0..7 (one 16-byte load broadcast to the 4 rows).

constexpr int kAct16Levels = 32767;

// 8 int16 activations in every 128-bit quarter: one row's columns for each of a tile's 4 rows.
__attribute__((target("avx512f"))) inline __m512i bcast8(const int16_t* p) {
  return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// y rows [m0, m0 + MB) x weight rows [r, r + nrows), nrows <= 4, as vnni_tile.
template <int MB>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c,fma"))) void a16_tile(const GroupWeights& w, const Acts16& x,
                                                                          float* y, int64_t m0, int64_t r, int nrows) {
  const __m512i field = _mm512_set1_epi16(0x000F);
  const int64_t per_group = w.group / kBlock;
  const int64_t ahead = w.tiled ? 1024 : 0;
  const __m512i row_of_lane = _mm512_loadu_si512(kRowOfLane<4>[0]);
  __m512 acc[MB][1];
  __m128 zacc[MB];
  for (int k = 0; k < MB; ++k) acc[k][0] = _mm512_setzero_ps(), zacc[k] = _mm_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    __m512 gacc[MB];
    for (int k = 0; k < MB; ++k) gacc[k] = _mm512_setzero_ps();
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(w.run(r, b)) + ahead, _MM_HINT_T0);
      __m512i v[1];
      load_rows<4>(w, r, b, nrows, v);
      const __m512i f0 = _mm512_and_si512(v[0], field);
      const __m512i f1 = _mm512_and_si512(_mm512_srli_epi16(v[0], 4), field);
      const __m512i f2 = _mm512_and_si512(_mm512_srli_epi16(v[0], 8), field);
      const __m512i f3 = _mm512_srli_epi16(v[0], 12);
      for (int k = 0; k < MB; ++k) {
        const int16_t* xq = x.q + (m0 + k) * x.in + b * kBlock;
        const __m512i d01 = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), f0, bcast8(xq)), f1,
                                                bcast8(xq + 8));
        const __m512i d23 = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), f2, bcast8(xq + 16)), f3,
                                                bcast8(xq + 24));
        gacc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(d01, d23)),
                                  _mm512_set1_ps(x.a[(m0 + k) * x.blocks + b]), gacc[k]);
      }
    }
    __m128 s4, z4;
    group_params<4>(w, r, g, nrows, s4, z4);
    const __m512 svec = _mm512_permutexvar_ps(row_of_lane, _mm512_castps128_ps512(s4));
    for (int k = 0; k < MB; ++k) {
      acc[k][0] = _mm512_fmadd_ps(gacc[k], svec, acc[k][0]);
      zacc[k] = _mm_fmadd_ps(z4, _mm_set1_ps(x.c[(m0 + k) * x.groups + g]), zacc[k]);
    }
  }
  for (int k = 0; k < MB; ++k) {
    alignas(16) float t[4];
    _mm_store_ps(t, _mm_add_ps(row_sums<1>(acc[k]), zacc[k]));
    for (int j = 0; j < nrows; ++j) y[(m0 + k) * w.out + r + j] = t[j];
  }
}

struct A16Kernel {
  static constexpr bool kWide = false;
  template <int MB>
  static void tile(const GroupWeights& w, const Acts16& x, float* y, int64_t m0, int64_t r, int nrows) {
    a16_tile<MB>(w, x, y, m0, r, nrows);
  }
};

// ---- the same kernels on 256-bit vectors: AVX2, and AVX-VNNI where the CPU has it ----------------
// (cpu_quant_simd256.inc; the AVX-512 level's int16_pair8 below borrows avx2's loaders)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#include "cpu_quant_simd256.inc"
}  // namespace avx2
#pragma GCC pop_options

// AVX-VNNI (Alder Lake and later client cores, Sapphire Rapids, Zen 5's 256-bit VEX form):
// vpdpbusd / vpdpwssd on the same 256-bit vectors, the same integers, so the same bits.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace avxvnni {
#define BRISK_QUANT_AVX_VNNI 1
#include "cpu_quant_simd256.inc"
#undef BRISK_QUANT_AVX_VNNI
}  // namespace avxvnni
#pragma GCC pop_options

// avx2::int16_tile8 on two tiles (rows r..r+7) at once, AVX-512 (BW): every 512-bit vector's low half
// is int16_tile8's 256-bit vector for the first tile, its high half that for the second, fed the
// same operations in the same order (vpmaddwd, vpsllw/vpsraw, vcvtdq2ps and vfmadd act within
// their lanes; vphaddd, which has no 512-bit form, becomes the even + odd lanes of vshufps: the same
// integer sums), so each tile's results are its int16_tile8 bits. The Q8_0 layers and heads of GGUF
// files (the default model's head) spent half their decode time in int16_tile8 at this level.
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) inline __m512i hadd512(__m512i a, __m512i b) {
  const __m512 fa = _mm512_castsi512_ps(a), fb = _mm512_castsi512_ps(b);
  const __m512i even = _mm512_castps_si512(_mm512_shuffle_ps(fa, fb, _MM_SHUFFLE(2, 0, 2, 0)));
  const __m512i odd = _mm512_castps_si512(_mm512_shuffle_ps(fa, fb, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_epi32(even, odd);  // per 128-bit lane: [a0+a1, a2+a3, b0+b1, b2+b3], vphaddd's
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) inline __m512i join512(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

template <int MB, int PG>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) void int16_pair8(
    const GroupWeights& w, const Acts16& x, float* y, int64_t m0, int64_t r) {
  __m512 acc[MB];
  for (int k = 0; k < MB; ++k) acc[k] = _mm512_setzero_ps();
  const uint8_t* p0 = w.run(r, 0);
  const uint8_t* p1 = w.run(r + 4, 0);
  const int64_t blocks = PG ? PG : w.group / kBlock;
  for (int64_t g = 0; g < w.groups; ++g) {
    __m512 gacc[MB];
    for (int k = 0; k < MB; ++k) gacc[k] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int64_t e = 0; e < blocks; ++e) {
      const int64_t b = g * blocks + e;
      __m256i v0[4], v1[4];
      p0 = avx2::load_run<8, PG>(w, r, b, 4, p0, v0);
      p1 = avx2::load_run<8, PG>(w, r + 4, b, 4, p1, v1);
      __m512i even[4], odd[4];
      for (int i = 0; i < 4; ++i) {
        const __m512i v = join512(v0[i], v1[i]);
        even[i] = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8);
        odd[i] = _mm512_srai_epi16(v, 8);
      }
      for (int k = 0; k < MB; ++k) {
        const int16_t* xq = x.q + (m0 + k) * x.in + b * kBlock;
        const __m256i x0h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
        const __m256i x1h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16));
        const __m512i x0 = join512(x0h, x0h), x1 = join512(x1h, x1h);
        __m512i d[4];
        for (int i = 0; i < 4; ++i)
          d[i] = _mm512_add_epi32(_mm512_madd_epi16(even[i], x0), _mm512_madd_epi16(odd[i], x1));
        const __m512i rows = hadd512(hadd512(d[0], d[1]), hadd512(d[2], d[3]));
        gacc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(rows), _mm512_set1_ps(x.a[(m0 + k) * x.blocks + b]), gacc[k]);
      }
    }
    __m128 s0, s1, z;
    group_params<8>(w, r, g, 4, s0, z);
    group_params<8>(w, r + 4, g, 4, s1, z);
    const __m512 s8 = _mm512_castpd_ps(_mm512_insertf64x4(
        _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_set_m128(s0, s0))), _mm256_castps_pd(_mm256_set_m128(s1, s1)), 1));
    for (int k = 0; k < MB; ++k) acc[k] = _mm512_fmadd_ps(gacc[k], s8, acc[k]);
  }
  for (int k = 0; k < MB; ++k)
    for (int h = 0; h < 2; ++h) {
      const __m256 a = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[k]), h));
      alignas(16) float t[4];
      _mm_store_ps(t, _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)));
      for (int j = 0; j < 4; ++j) y[(m0 + k) * w.out + r + 4 * h + j] = t[j];
    }
}

struct Int16Kernel512x8 : avx2::Int16Kernel256x8 {
  // rows r..r+7 (two whole tiles) for MB rows of x
  template <int MB>
  static void pair(const GroupWeights& w, const Acts16& x, float* y, int64_t m0, int64_t r) {
    avx2::with_blocks(w, [&](auto pg) { int16_pair8<MB, decltype(pg)::value>(w, x, y, m0, r); });
  }
};
template <>
constexpr bool kPairs<Int16Kernel512x8> = true;
#endif  // BRISK_X86

// ---- the portable path -----------------------------------------------------------------------
// quantize_act_row one value at a time: the same integers and floats (max, IEEE division, round
// half to even, clamp; exact integer block sums, C_g one fma a block as there). Compiled for the
// baseline ISA and, for the AVX2 kernels, for AVX2 + FMA (where nearbyint and fma are instructions).
#define BRISK_QUANTIZE_ROW(NAME, ATTR)                                                                   \
  template <typename T, int Levels>                                                                       \
  ATTR void NAME(const float* x, const GroupWeights& w, T* q, float* a, float* c) {                       \
    const int64_t per_group = w.group / kBlock;                                                           \
    for (int64_t g = 0; g < w.groups; ++g) {                                                              \
      float cg = 0.0f;                                                                                    \
      for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {                                     \
        const float* xb = x + b * kBlock;                                                                 \
        float amax = 0.0f;                                                                                \
        for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));                         \
        const float ab = amax / static_cast<float>(Levels);                                               \
        int32_t v[kBlock] = {};                                                                           \
        int32_t sum = 0;                                                                                  \
        if (ab > 0.0f) {                                                                                  \
          const float l = static_cast<float>(Levels);                                                     \
          for (int i = 0; i < kBlock; ++i) {                                                              \
            v[i] = static_cast<int32_t>(std::min(std::max(std::nearbyint(xb[i] / ab), -l), l));           \
            sum += v[i];                                                                                  \
          }                                                                                               \
        }                                                                                                 \
        T* qb = q + b * kBlock;                                                                           \
        for (int i = 0; i < kBlock; ++i) qb[act_slot<T>(i)] = static_cast<T>(v[i]);                       \
        a[b] = ab;                                                                                        \
        cg = std::fma(ab, static_cast<float>(sum), cg);                                                   \
      }                                                                                                   \
      c[g] = cg;                                                                                          \
    }                                                                                                     \
  }

// Where column i of a 32-column block is stored: in place (int8), or at a16_tile's permuted slot
// (int16: slot 8 e + m holds column 2 m + e / 2 + 16 (e % 2)).
template <typename T>
constexpr int act_slot(int i) {
  if constexpr (sizeof(T) == 1) return i;
  const int high = i >= 16, rem = i - 16 * high;
  return 8 * (2 * (rem % 2) + high) + rem / 2;
}

BRISK_QUANTIZE_ROW(quantize_act_row_portable, )
#ifdef BRISK_X86
BRISK_QUANTIZE_ROW(quantize_act_row_avx2, __attribute__((target("avx2,fma"))))
#endif
#undef BRISK_QUANTIZE_ROW

// The tile kernels' integers and floats one lane at a time. A weight row's int32 lane t sums, per
// 32-column block, 4-bit: columns 4t..4t+3 and 16+4t..16+4t+3 (4 lanes; int8 and int16 acts
// alike), 8-bit: columns 4t..4t+3 with q + 128 (8 lanes). Each lane's float steps and the final
// lane sums follow vnni_tile / a16_tile and row_sums, so the results are theirs, bit for bit.
// 8-bit weights x int16 acts follow int16_tile8 instead (portable_rows_a16x8).
template <int Bits, typename T>
void portable_rows(const GroupWeights& w, const ActsT<T>& x, float* y, int64_t m, int64_t r0, int64_t r1) {
  constexpr int L = Bits == 4 ? 4 : 8;
  const int64_t per_group = w.group / kBlock;
  for (int64_t r = r0; r < std::min(r1, w.out); ++r) {
    for (int64_t k = 0; k < m; ++k) {
      float acc[L] = {}, zacc = 0.0f;
      for (int64_t g = 0; g < w.groups; ++g) {
        const float s = c10::detail::fp16_ieee_to_fp32_value(w.scale[w.at(r, g)]);
        const float z = Bits == 4 ? c10::detail::fp16_ieee_to_fp32_value(w.zero[w.at(r, g)]) : -128.0f * s;
        float gacc[L] = {};
        for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
          const uint8_t* p = w.run(r, b);
          const T* xq = x.q + k * x.in + b * kBlock;
          int32_t d[L] = {};
          if constexpr (Bits == 4) {
            for (int c = 0; c < 16; ++c)
              d[c / 4] += (p[c] & 15) * xq[act_slot<T>(c)] + (p[c] >> 4) * xq[act_slot<T>(c + 16)];
          } else {
            for (int c = 0; c < 32; ++c) d[c / 4] += (static_cast<int8_t>(p[c]) + 128) * xq[c];
          }
          const float ab = x.a[k * x.blocks + b];
          for (int t = 0; t < L; ++t) gacc[t] = std::fma(static_cast<float>(d[t]), ab, gacc[t]);
        }
        for (int t = 0; t < L; ++t) acc[t] = std::fma(gacc[t], s, acc[t]);
        zacc = std::fma(z, x.c[k * x.groups + g], zacc);
      }
      float lanes[4];
      for (int t = 0; t < 4; ++t) lanes[t] = L == 4 ? acc[t] : acc[t] + acc[t + 4];
      y[k * w.out + r] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + zacc;
    }
  }
}

// int16_tile8 one row at a time: per block, the row's two int32 half sums (columns 0-15, 16-31), each
// rounded to float, times the block's activation scale into the group's two lanes; those times the
// row's scale into the row's two lanes; their sum.
void portable_rows_a16x8(const GroupWeights& w, const Acts16& x, float* y, int64_t m, int64_t r0, int64_t r1) {
  const int64_t per_group = w.group / kBlock;
  for (int64_t r = r0; r < std::min(r1, w.out); ++r) {
    for (int64_t k = 0; k < m; ++k) {
      float acc[2] = {};
      for (int64_t g = 0; g < w.groups; ++g) {
        const float s = c10::detail::fp16_ieee_to_fp32_value(w.scale[w.at(r, g)]);
        float gacc[2] = {};
        for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
          const uint8_t* p = w.run(r, b);
          const int16_t* xq = x.q + k * x.in + b * kBlock;
          int32_t d[2] = {};
          for (int c = 0; c < 32; ++c) d[c / 16] += static_cast<int8_t>(p[c]) * xq[act_slot<int16_t>(c)];
          const float ab = x.a[k * x.blocks + b];
          for (int h = 0; h < 2; ++h) gacc[h] = std::fma(static_cast<float>(d[h]), ab, gacc[h]);
        }
        for (int h = 0; h < 2; ++h) acc[h] = std::fma(gacc[h], s, acc[h]);
      }
      y[k * w.out + r] = acc[0] + acc[1];
    }
  }
}

template <typename T, int Levels>
void quantize_rows_into(const GroupWeights& w, const float* x, int64_t m, std::vector<T>& q,
                        brisk_range::QuantizedActs& out) {
  const int64_t in = w.in, groups = w.groups;
  out.levels = Levels;
  q.resize(m * in), out.a.resize(m * (in / kBlock)), out.c.resize(m * groups);
  for (int64_t i = 0; i < m; ++i) {
    T* qi = q.data() + i * in;
    float *ai = out.a.data() + i * (in / kBlock), *ci = out.c.data() + i * groups;
#ifdef BRISK_X86
    if (brisk_isa::vnni()) {
      quantize_act_row<T, Levels>(x + i * in, w, qi, ai, ci);
      continue;
    }
    if (brisk_isa::at_least_avx2()) {
      quantize_act_row_avx2<T, Levels>(x + i * in, w, qi, ai, ci);
      continue;
    }
#endif
    quantize_act_row_portable<T, Levels>(x + i * in, w, qi, ai, ci);
  }
}

// The acts of x's rows quantized for `w` (levels 127: int8, 32767: int16).
template <typename T>
ActsT<T> acts_of(const GroupWeights& w, const brisk_range::QuantizedActs& x) {
  const T* q;
  if constexpr (sizeof(T) == 1) q = x.q8.data();
  else q = x.q16.data();
  return ActsT<T>{q, x.a.data(), x.c.data(), w.in, w.in / kBlock, w.groups};
}

// Quantize x's rows into scratch kept per calling thread (decode calls these kernels ~120 times a
// token: three allocations each were measurable), then multiply.
torch::Tensor qact_gemm(const char* name, int levels, const torch::Tensor& x, const GroupWeights& w,
                        const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == w.in, "brisk ", name, ": x does not fit the weight");
  const int64_t m = x.size(0);
  auto xf = x.to(torch::kFloat32).contiguous();
  auto y = torch::empty({m, w.out}, x.options().dtype(torch::kFloat32));
  thread_local brisk_range::QuantizedActs scratch;
  brisk_range::QuantizedActs& acts = scratch;  // the pool's threads read the caller's (a lambda naming
                                              // a thread_local would find each thread's own)
  brisk_range::quantize_acts(levels, w, xf.data_ptr<float>(), m, acts);
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (w.out + 3) / 4, 4,
                   [&](int64_t t0, int64_t t1) { brisk_range::group_qact_rows(w, acts, yp, m, 4 * t0, 4 * t1); });
  if (bias.has_value()) y.add_(bias->to(torch::kFloat32));
  return y;
}

#ifdef BRISK_X86
// Tiles [t0, t1) on the 256-bit kernels of one namespace (avx2 or avxvnni: the same bits).
template <typename K>
void rows256(const GroupWeights& w, const brisk_range::QuantizedActs& x, float* y, int64_t m, int64_t t0, int64_t t1) {
  if (x.levels == kAct16Levels) {
    if (w.run_bytes != 16) return tile_range<typename K::A16x8>(w, acts_of<int16_t>(w, x), y, m, t0, t1);
    return tile_range<typename K::A16x4>(w, acts_of<int16_t>(w, x), y, m, t0, t1);
  }
  if (w.run_bytes == 16) return tile_range<typename K::A8x4>(w, acts_of<int8_t>(w, x), y, m, t0, t1);
  tile_range<typename K::A8x8>(w, acts_of<int8_t>(w, x), y, m, t0, t1);
}
#endif

}  // namespace

// y[M, out] = quantize_act_blocks(x) @ W^T (+ bias) up to float rounding (the sums run in another
// order than a float GEMM's): W as group_gemm's, x quantized to int8 per row and 32-column block.
torch::Tensor group_gemm_q8act(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                               const c10::optional<torch::Tensor>& zero, int64_t group, int64_t bits,
                               const c10::optional<torch::Tensor>& bias, bool tiled) {
  const GroupWeights w = brisk_group::check_group_weights(q, scale, zero, group, bits, tiled);
  return qact_gemm("group_gemm_q8act", 127, x, w, bias);
}

// y[M, out] = quantize_act_blocks(x, "int16") @ W^T (+ bias) up to float rounding: W as group_gemm's
// (4-bit or 8-bit), x quantized to int16 per row and 32-column block.
torch::Tensor group_gemm_q16act(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                                const c10::optional<torch::Tensor>& zero, int64_t group, int64_t bits,
                                const c10::optional<torch::Tensor>& bias, bool tiled) {
  const GroupWeights w = brisk_group::check_group_weights(q, scale, zero, group, bits, tiled);
  return qact_gemm("group_gemm_q16act", kAct16Levels, x, w, bias);
}

namespace brisk_range {

void quantize_acts(int levels, const GroupWeights& w, const float* x, int64_t m, QuantizedActs& out) {
  if (levels == kAct16Levels) quantize_rows_into<int16_t, kAct16Levels>(w, x, m, out.q16, out);
  else quantize_rows_into<int8_t, 127>(w, x, m, out.q8, out);
}

// Weight rows [r0, r1) (r0 a multiple of 4) of the integer-activation group kernels on x quantized
// by quantize_acts: AVX512-VNNI where the CPU has it, else the 256-bit kernels (on AVX-VNNI where
// the CPU has it), else the portable loop (all bit-identical).
void group_qact_rows(const GroupWeights& w, const QuantizedActs& x, float* y, int64_t m, int64_t r0, int64_t r1) {
  const bool a16 = x.levels == kAct16Levels;
#ifdef BRISK_X86
  const int64_t t0 = r0 / 4, t1 = (std::min(r1, w.out) + 3) / 4;
  if (a16 && w.run_bytes != 16 && brisk_isa::vnni())  // AVX-512 with BW: two tiles a pass, the same bits
    return tile_range<Int16Kernel512x8>(w, acts_of<int16_t>(w, x), y, m, t0, t1);
  if (brisk_isa::vnni()) {
    if (a16) return tile_range<A16Kernel>(w, acts_of<int16_t>(w, x), y, m, t0, t1);
    if (w.run_bytes == 16) return tile_range<VnniKernel<4>>(w, acts_of<int8_t>(w, x), y, m, t0, t1);
    return tile_range<VnniKernel<8>>(w, acts_of<int8_t>(w, x), y, m, t0, t1);
  }
  if (brisk_isa::avx_vnni()) return rows256<avxvnni::Kernels>(w, x, y, m, t0, t1);
  if (brisk_isa::at_least_avx2()) return rows256<avx2::Kernels>(w, x, y, m, t0, t1);
#endif
  if (a16 && w.run_bytes == 16) return portable_rows<4>(w, acts_of<int16_t>(w, x), y, m, r0, r1);
  if (a16) return portable_rows_a16x8(w, acts_of<int16_t>(w, x), y, m, r0, r1);
  if (w.run_bytes == 16) return portable_rows<4>(w, acts_of<int8_t>(w, x), y, m, r0, r1);
  portable_rows<8>(w, acts_of<int8_t>(w, x), y, m, r0, r1);
}

}  // namespace brisk_range
