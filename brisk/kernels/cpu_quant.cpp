// Group-quantized weights (quant/grouped.py): 4-bit with a float scale and offset per group of
// input columns, or 8-bit with a scale per group. One layout serves brisk's int4 method and the
// GGUF blocks Q4_0, Q4_1 and Q8_0, kept quantized at run time.
//
//   4-bit: q [out, in / 2] uint8. Every 32 columns take 16 bytes, GGUF's order: byte j holds
//          column j in its low nibble and column j + 16 in its high nibble.
//          w[o, i] = q * scale[o, g] + zero[o, g]   (g = i / group), computed as one fma
//   8-bit: q [out, in] int8, w[o, i] = q * scale[o, g]
//   scale and zero are float16 [out, in / group], as GGUF stores d and m: a float32 pair would
//   add a third to the bytes a 4-bit decode step reads at group 32.
//   tiled: q holds tiles of 4 rows x one 32-column run (4 x 16 bytes at 4-bit, 4 x 32 at 8-bit)
//          side by side, tiles in (row group, run) order (quant/base.py tile_rows): a thread's rows
//          are then one sequential stream that the hardware prefetchers follow, not four; scale
//          and zero tiled alike, 4 rows x 1 group (a group's 4 scales are 8 contiguous bytes).
//
// Decode reads every weight once per token, so the kernels stream q once for all rows of x.
// A 4-bit group is turned into floats through a 16-entry table (scale * [0..15] + zero, one fma
// per group): vpermps looks up 16 weights per instruction from the nibbles, no int->float
// conversion. Each (x row, weight row) pair has one float32 accumulator summed in column order,
// so a row's result does not depend on how many rows share the call (batch invariance), and
// `group_dequantize` produces exactly the weights the kernel multiplies by.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>

#include "group_weights.h"
#include "kernels.h"
#include "simd.h"

namespace {

using brisk_group::GroupWeights;

#ifdef BRISK_X86
constexpr int64_t kChunk = 32;  // columns per 16-byte nibble run (and per Q8_0 block)

// The 32 weights of row `r` at columns [i, i + 32) as two float vectors. `lut` is the current
// group's table (4-bit) or its scale broadcast (8-bit).
template <int Bits>
struct Unpack;

template <>
struct Unpack<4> {
  __attribute__((target("avx512f,f16c"))) static inline __m512 table(uint16_t s, uint16_t z) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_fmadd_ps(iota, _mm512_set1_ps(_cvtsh_ss(s)), _mm512_set1_ps(_cvtsh_ss(z)));
  }
  __attribute__((target("avx512f"))) static inline void load(const uint8_t* p, __m512 lut, __m512& lo, __m512& hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_permutexvar_ps(v, lut);  // vpermps reads only the index's low 4 bits
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut);
  }
  static constexpr int64_t row_bytes(int64_t in) { return in / 2; }
};

template <>
struct Unpack<8> {
  __attribute__((target("avx512f,f16c"))) static inline __m512 table(uint16_t s, uint16_t) {
    return _mm512_set1_ps(_cvtsh_ss(s));
  }
  __attribute__((target("avx512f"))) static inline void load(const uint8_t* q, __m512 s, __m512& lo, __m512& hi) {
    const int8_t* p = reinterpret_cast<const int8_t*>(q);
    lo = _mm512_mul_ps(brisk_simd::load16(p), s);  // |q| * scale: 8 x 11 bits, exact for fp16 scales
    hi = _mm512_mul_ps(brisk_simd::load16(p + 16), s);
  }
  static constexpr int64_t row_bytes(int64_t in) { return in; }
};

// y rows [m0, m0 + MB) x weight rows [r, r + R). Each (x row, weight row) pair keeps two
// accumulators (the low and the high 16 columns of every 32) summed in column order and added at
// the end, whatever MB and R are: a row's result does not depend on the batch it came in.
// R weight rows at once give the cores R * MB * 2 independent fma chains; with one chain the
// 4-cycle fma latency, not memory, set the pace (measured: 18 GMAC/s -> see kernel notes).
template <int Bits, int MB, int R>
__attribute__((target("avx512f,f16c"))) inline void gemm_tile(const GroupWeights& w, const float* x, float* y, int64_t m0,
                                                         int64_t r) {
  const int64_t rb = Unpack<Bits>::row_bytes(w.in);
  // the tile after next comes from DRAM: ask for it now so the loads overlap this work (row-major:
  // R rows further on; tiled: 1 KB further along the one stream)
  const int64_t ahead = w.tiled ? 1024 : 2 * R * rb;
  __m512 lo_acc[R][MB], hi_acc[R][MB];
  for (int j = 0; j < R; ++j)
    for (int k = 0; k < MB; ++k) lo_acc[j][k] = hi_acc[j][k] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    __m512 lut[R];
    for (int j = 0; j < R; ++j) {
      const int64_t at = w.at(r + j, g);
      lut[j] = Unpack<Bits>::table(w.scale[at], w.zero ? w.zero[at] : 0);
    }
    for (int64_t i = g * w.group; i < (g + 1) * w.group; i += kChunk) {
      for (int j = 0; j < R; ++j) {
        const uint8_t* p = w.run(r + j, i / kChunk);
        _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T0);
        __m512 lo, hi;
        Unpack<Bits>::load(p, lut[j], lo, hi);
        for (int k = 0; k < MB; ++k) {
          const float* xr = x + (m0 + k) * w.in + i;
          lo_acc[j][k] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), lo_acc[j][k]);
          hi_acc[j][k] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), hi_acc[j][k]);
        }
      }
    }
  }
  for (int j = 0; j < R; ++j)
    for (int k = 0; k < MB; ++k)
      y[(m0 + k) * w.out + r + j] = _mm512_reduce_add_ps(_mm512_add_ps(lo_acc[j][k], hi_acc[j][k]));
}

template <int Bits, int MB, int R>
void gemm_rows(const GroupWeights& w, const float* x, float* y, int64_t m0, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + R <= r1; r += R) gemm_tile<Bits, MB, R>(w, x, y, m0, r);
  for (; r < r1; ++r) gemm_tile<Bits, MB, 1>(w, x, y, m0, r);
}

// Weight rows [r0, r1) for all rows of x: blocks of 8, 4, 2, 1 x rows, weight rows per tile so
// that 16 accumulators are live.
template <int Bits>
void gemm_range(const GroupWeights& w, const float* x, float* y, int64_t m_rows, int64_t r0, int64_t r1) {
  int64_t m0 = 0;
  for (; m0 + 8 <= m_rows; m0 += 8) gemm_rows<Bits, 8, 1>(w, x, y, m0, r0, r1);
  for (; m0 + 4 <= m_rows; m0 += 4) gemm_rows<Bits, 4, 2>(w, x, y, m0, r0, r1);
  for (; m0 + 2 <= m_rows; m0 += 2) gemm_rows<Bits, 2, 4>(w, x, y, m0, r0, r1);
  for (; m0 < m_rows; ++m0) gemm_rows<Bits, 1, 4>(w, x, y, m0, r0, r1);
}

// Weight row r as floats into o [in].
template <int Bits>
__attribute__((target("avx512f,f16c"))) void dequant_row(const GroupWeights& w, int64_t r, float* o) {
  for (int64_t g = 0; g < w.groups; ++g) {
    const __m512 lut = Unpack<Bits>::table(w.scale[w.at(r, g)], w.zero ? w.zero[w.at(r, g)] : 0);
    for (int64_t i = g * w.group; i < (g + 1) * w.group; i += kChunk) {
      __m512 lo, hi;
      Unpack<Bits>::load(w.run(r, i / kChunk), lut, lo, hi);
      _mm512_storeu_ps(o + i, lo);
      _mm512_storeu_ps(o + i + 16, hi);
    }
  }
}
#endif

// The portable path, for CPUs without AVX2 (the AVX2 kernel below computes the same floats). Every
// (x row, weight row) pair sums in 8 lanes, in column order, added at the end: batch-invariant like
// the AVX-512 path, and within float rounding of it (another order). 4-bit: each run of 32 weights
// is dequantized as the AVX-512 table does (fma(q, scale, zero)) and multiplied in; 8-bit: q x sums
// over the group, then one fma by the group's scale (a multiply per weight fewer: the 8-bit head
// is the largest matrix of a decode step, and on 8-lane vectors its instructions, not memory, set
// the pace).
inline void unpack_run(const GroupWeights& w, int64_t r, int64_t c, float s, float z, float* o) {
  const uint8_t* p = w.run(r, c);
  if (w.run_bytes == 16) {
    for (int j = 0; j < 16; ++j) {
      o[j] = std::fma(static_cast<float>(p[j] & 15), s, z);
      o[j + 16] = std::fma(static_cast<float>(p[j] >> 4), s, z);
    }
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(p);
    for (int j = 0; j < 32; ++j) o[j] = static_cast<float>(q[j]) * s;
  }
}

inline float half(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

void gemm_range_portable(const GroupWeights& w, const float* x, float* y, int64_t m, int64_t r0, int64_t r1) {
  constexpr int kMaxM = 16;
  const bool eight = w.run_bytes == 32;
  float run[32];
  for (int64_t m0 = 0; m0 < m; m0 += kMaxM) {
    const int64_t mb = std::min<int64_t>(kMaxM, m - m0);
    for (int64_t r = r0; r < r1; ++r) {
      float acc[kMaxM][8] = {};
      for (int64_t g = 0; g < w.groups; ++g) {
        const int64_t at = w.at(r, g);
        const float s = half(w.scale[at]), z = w.zero ? half(w.zero[at]) : 0.0f;
        float gacc[kMaxM][8] = {};  // 8-bit: the group's q x sums
        for (int64_t i = g * w.group; i < (g + 1) * w.group; i += 32) {
          if (eight) {
            const int8_t* q = reinterpret_cast<const int8_t*>(w.run(r, i / 32));
            for (int j = 0; j < 32; ++j) run[j] = static_cast<float>(q[j]);
          } else {
            unpack_run(w, r, i / 32, s, z, run);
          }
          for (int64_t k = 0; k < mb; ++k) {
            const float* xr = x + (m0 + k) * w.in + i;
            float* a = eight ? gacc[k] : acc[k];
            for (int j = 0; j < 32; j += 8)
              for (int l = 0; l < 8; ++l) a[l] = std::fma(run[j + l], xr[j + l], a[l]);
          }
        }
        if (eight)
          for (int64_t k = 0; k < mb; ++k)
            for (int l = 0; l < 8; ++l) acc[k][l] = std::fma(gacc[k][l], s, acc[k][l]);
      }
      for (int64_t k = 0; k < mb; ++k) {
        float sum = 0.0f;
        for (int l = 0; l < 8; ++l) sum += acc[k][l];
        y[(m0 + k) * w.out + r] = sum;
      }
    }
  }
}

#ifdef BRISK_X86
// The portable path's arithmetic on 256-bit vectors: the same weights and group sums, the same
// 8-lane accumulators in column order and the same final lane sum,
// so its results are the portable path's bit for bit (where that one is compiled with FMA), at
// vector speed: R weight rows x MB x rows per tile share every load.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

// The 8 lanes added in order (the portable path's sum).
inline float lane_sum(__m256 v) {
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  float sum = 0.0f;
  for (int l = 0; l < 8; ++l) sum += t[l];
  return sum;
}

// Row r's run of 32 columns as four vectors of 8 floats.
template <int Bits>
inline void unpack(const uint8_t* p, __m256 s, __m256 z, __m256 (&w)[4]) {
  if constexpr (Bits == 4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);  // columns 0-15, 16-31
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), s, z);
  } else {
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i)))), s);
  }
}

// 8-bit: per group, q x summed in `gacc`, then one fma by the scale (the portable path's order).
template <int MB, int R>
inline void tile8(const GroupWeights& w, const float* x, float* y, int64_t m0, int64_t r) {
  const int64_t ahead = w.tiled ? 1024 : 2 * R * w.run_bytes * (w.in / 32);
  __m256 acc[R][MB];
  for (int j = 0; j < R; ++j)
    for (int k = 0; k < MB; ++k) acc[j][k] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    __m256 gacc[R][MB];
    for (int j = 0; j < R; ++j)
      for (int k = 0; k < MB; ++k) gacc[j][k] = _mm256_setzero_ps();
    for (int64_t i = g * w.group; i < (g + 1) * w.group; i += 32) {
      if (w.tiled) {
        const char* p = reinterpret_cast<const char*>(w.run(r, i / 32)) + ahead;
        _mm_prefetch(p, _MM_HINT_T0);
        _mm_prefetch(p + 64, _MM_HINT_T0);
      }
      for (int j = 0; j < R; ++j) {
        const uint8_t* p = w.run(r + j, i / 32);
        if (!w.tiled) _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T0);
        __m256 qv[4];
        for (int c = 0; c < 4; ++c)
          qv[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * c))));
        for (int k = 0; k < MB; ++k) {
          const float* xr = x + (m0 + k) * w.in + i;
          for (int c = 0; c < 4; ++c) gacc[j][k] = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(xr + 8 * c), gacc[j][k]);
        }
      }
    }
    for (int j = 0; j < R; ++j) {
      const __m256 s = _mm256_set1_ps(_cvtsh_ss(w.scale[w.at(r + j, g)]));
      for (int k = 0; k < MB; ++k) acc[j][k] = _mm256_fmadd_ps(gacc[j][k], s, acc[j][k]);
    }
  }
  for (int j = 0; j < R; ++j)
    for (int k = 0; k < MB; ++k) y[(m0 + k) * w.out + r + j] = lane_sum(acc[j][k]);
}

template <int Bits, int MB, int R>
inline void tile(const GroupWeights& w, const float* x, float* y, int64_t m0, int64_t r) {
  if constexpr (Bits == 8) {
    return tile8<MB, R>(w, x, y, m0, r);
  }
  const int64_t ahead = w.tiled ? 1024 : 2 * R * w.run_bytes * (w.in / 32);
  __m256 acc[R][MB];
  for (int j = 0; j < R; ++j)
    for (int k = 0; k < MB; ++k) acc[j][k] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    __m256 s[R], z[R];
    for (int j = 0; j < R; ++j) {
      const int64_t at = w.at(r + j, g);
      s[j] = _mm256_set1_ps(_cvtsh_ss(w.scale[at]));
      z[j] = _mm256_set1_ps(w.zero ? _cvtsh_ss(w.zero[at]) : 0.0f);
    }
    for (int64_t i = g * w.group; i < (g + 1) * w.group; i += 32) {
      if (w.tiled) {  // the 4-row tile's run is 64 (4-bit) or 128 bytes of one stream: one or two lines
        const char* p = reinterpret_cast<const char*>(w.run(r, i / 32)) + ahead;
        _mm_prefetch(p, _MM_HINT_T0);
      }
      for (int j = 0; j < R; ++j) {
        const uint8_t* p = w.run(r + j, i / 32);
        if (!w.tiled) _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T0);
        __m256 wv[4];
        unpack<Bits>(p, s[j], z[j], wv);
        for (int k = 0; k < MB; ++k) {
          const float* xr = x + (m0 + k) * w.in + i;
          for (int c = 0; c < 4; ++c) acc[j][k] = _mm256_fmadd_ps(wv[c], _mm256_loadu_ps(xr + 8 * c), acc[j][k]);
        }
      }
    }
  }
  for (int j = 0; j < R; ++j)
    for (int k = 0; k < MB; ++k) y[(m0 + k) * w.out + r + j] = lane_sum(acc[j][k]);
}

template <int Bits, int MB, int R>
void rows(const GroupWeights& w, const float* x, float* y, int64_t m0, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + R <= r1; r += R) tile<Bits, MB, R>(w, x, y, m0, r);
  for (; r < r1; ++r) tile<Bits, MB, 1>(w, x, y, m0, r);
}

template <int Bits>
void gemm_range(const GroupWeights& w, const float* x, float* y, int64_t m, int64_t r0, int64_t r1) {
  int64_t m0 = 0;
  for (; m0 + 4 <= m; m0 += 4) rows<Bits, 4, Bits == 8 ? 1 : 2>(w, x, y, m0, r0, r1);  // 8-bit: 16 registers
  for (; m0 + 2 <= m; m0 += 2) rows<Bits, 2, 2>(w, x, y, m0, r0, r1);
  for (; m0 < m; ++m0) rows<Bits, 1, 4>(w, x, y, m0, r0, r1);
}

// Weight row r as floats into o [in]: unpack_run's values.
template <int Bits>
void dequant_row(const GroupWeights& w, int64_t r, float* o) {
  for (int64_t g = 0; g < w.groups; ++g) {
    const int64_t at = w.at(r, g);
    const __m256 s = _mm256_set1_ps(_cvtsh_ss(w.scale[at])), z = _mm256_set1_ps(w.zero ? _cvtsh_ss(w.zero[at]) : 0.0f);
    for (int64_t i = g * w.group; i < (g + 1) * w.group; i += 32) {
      __m256 wv[4];
      unpack<Bits>(w.run(r, i / 32), s, z, wv);
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(o + i + 8 * c, wv[c]);
    }
  }
}

}  // namespace avx2
#pragma GCC pop_options
#endif

void gemm_range_any(const GroupWeights& w, const float* x, float* y, int64_t m, int64_t r0, int64_t r1) {
#ifdef BRISK_X86
  if (brisk_isa::avx512()) {
    if (w.run_bytes == 16) return gemm_range<4>(w, x, y, m, r0, r1);
    return gemm_range<8>(w, x, y, m, r0, r1);
  }
  if (brisk_isa::at_least_avx2()) {
    if (w.run_bytes == 16) return avx2::gemm_range<4>(w, x, y, m, r0, r1);
    return avx2::gemm_range<8>(w, x, y, m, r0, r1);
  }
#endif
  gemm_range_portable(w, x, y, m, r0, r1);
}

// All weight rows for all rows of x, split over the threads.
void gemm(const GroupWeights& w, const float* x, float* y, int64_t m_rows) {
  // tiled: whole row groups per thread, so every 4-row tile is one thread's
  const int64_t unit = w.tiled ? 4 : 1;
  at::parallel_for(0, w.out / unit, 16 / unit,
                   [&](int64_t u0, int64_t u1) { gemm_range_any(w, x, y, m_rows, u0 * unit, u1 * unit); });
}

void dequant_row_any(const GroupWeights& w, int64_t r, float* o) {
#ifdef BRISK_X86
  if (brisk_isa::avx512()) return w.run_bytes == 16 ? dequant_row<4>(w, r, o) : dequant_row<8>(w, r, o);
  if (brisk_isa::at_least_avx2()) return w.run_bytes == 16 ? avx2::dequant_row<4>(w, r, o) : avx2::dequant_row<8>(w, r, o);
#endif
  for (int64_t g = 0; g < w.groups; ++g) {
    const int64_t at = w.at(r, g);
    const float s = half(w.scale[at]), z = w.zero ? half(w.zero[at]) : 0.0f;
    for (int64_t i = g * w.group; i < (g + 1) * w.group; i += 32) unpack_run(w, r, i / 32, s, z, o + i);
  }
}

}  // namespace

// y[M, out] = x[M, in] @ W^T (+ bias), W group-quantized as above, accumulated in float32.
torch::Tensor group_gemm(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                         const c10::optional<torch::Tensor>& zero, int64_t group, int64_t bits,
                         const c10::optional<torch::Tensor>& bias, bool tiled) {
  const GroupWeights w = brisk_group::check_group_weights(q, scale, zero, group, bits, tiled);
  TORCH_CHECK(x.device().is_cpu(), "brisk group_gemm: x must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.in, "brisk group_gemm: x does not fit the weight");
  auto xf = x.to(torch::kFloat32).contiguous();
  auto y = torch::empty({x.size(0), w.out}, x.options().dtype(torch::kFloat32));
  gemm(w, xf.data_ptr<float>(), y.data_ptr<float>(), x.size(0));
  if (bias.has_value()) y.add_(bias->to(torch::kFloat32));
  return y;
}

// Rows `ids` of the float32 weight (embedding lookups of a quantized tied head): each row as
// `group_dequantize` gives it, without the dozen small torch ops of the Python gather.
torch::Tensor group_dequantize_rows(const torch::Tensor& q, const torch::Tensor& scale,
                                    const c10::optional<torch::Tensor>& zero, int64_t group, int64_t bits, bool tiled,
                                    const torch::Tensor& ids) {
  const GroupWeights w = brisk_group::check_group_weights(q, scale, zero, group, bits, tiled);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kLong && ids.device().is_cpu(),
              "brisk group_dequantize_rows: ids must be a 1-D int64 CPU tensor");
  const auto idx = ids.contiguous();
  const int64_t n = idx.numel();
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < w.out, "brisk group_dequantize_rows: row ", ip[i], " is outside 0..", w.out - 1);
  auto out = torch::empty({n, w.in}, scale.options().dtype(torch::kFloat32));
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) dequant_row_any(w, ip[i], o + i * w.in);
  return out;
}

// The float32 [out, in] weight the kernel computes with (for large batches and references).
torch::Tensor group_dequantize(const torch::Tensor& q, const torch::Tensor& scale,
                               const c10::optional<torch::Tensor>& zero, int64_t group, int64_t bits, bool tiled) {
  const GroupWeights w = brisk_group::check_group_weights(q, scale, zero, group, bits, tiled);
  auto out = torch::empty({w.out, w.in}, scale.options().dtype(torch::kFloat32));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, w.out, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) dequant_row_any(w, r, o + r * w.in);
  });
  return out;
}

namespace brisk_range {

void group_rows(const GroupWeights& w, const float* x, float* y, int64_t m, int64_t r0, int64_t r1) {
  gemm_range_any(w, x, y, m, r0, r1);
}

}  // namespace brisk_range
