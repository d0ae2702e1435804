// 2:4 semi-structured sparse Linears (quant/sparse24.py): of every 4 input columns of a weight row,
// 2 are kept. Only the kept half is stored and read, so a decode step streams ~56% of a float32
// weight's bytes (62.5% of an int8 one's).
//
// Layout, per weight row, in tiles of 32 input columns (8 groups of 4, 16 kept values):
//   values [out, tiles * 16]  float32, or int8 times a per-row scale (scale [out])
//   meta   [out, tiles]       int32: bits 2k..2k+1 hold the column within its group of kept value
//                             k (value k belongs to group k / 2), so value k multiplies
//                             x[32 t + 4 (k / 2) + ((meta >> 2k) & 3)]
// Columns past `in` (the last tile of a width not a multiple of 32) hold zero values.
//
// A row's dot product: per tile one broadcast of the meta word, a variable shift, a mask and an
// add give the 16 column indices and one two-register permute picks x's 16 values (AVX-512); on AVX2
// x is reordered once per call so that the shifted meta word alone indexes two in-lane permutes
// and a constant blend picks a half tile's 8 (dot_avx2). Every (x row, weight row) pair is summed the same way
// whatever the batch, so batched rows equal rows alone, bit for bit; a batch's rows share each
// tile's indices and values (dot_avx512 / dot_avx2 take four x rows a weight row).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

constexpr int64_t kTile = 32, kKept = 16;
constexpr int64_t kAhead = 1024;  // bytes of values prefetched ahead (rows run on into the next)

template <typename V>
float dot_scalar(const V* v, const int32_t* meta, const float* x, int64_t tiles) {
  float acc = 0.f;
  for (int64_t t = 0; t < tiles; ++t) {
    const uint32_t m = static_cast<uint32_t>(meta[t]);
    for (int k = 0; k < kKept; ++k)
      acc += static_cast<float>(v[t * kKept + k]) * x[t * kTile + 4 * (k >> 1) + ((m >> (2 * k)) & 3)];
  }
  return acc;
}

#ifdef BRISK_X86
template <typename V>
__attribute__((target("avx512f"))) inline __m512 values16(const V* v) {
  if constexpr (std::is_same_v<V, float>) return _mm512_loadu_ps(v);
  else return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v))));
}

// The 16 kept values' columns within their 32-column tile, from its meta word.
__attribute__((target("avx512f"))) inline __m512i columns16(int32_t word) {
  const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i base = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
  return _mm512_add_epi32(_mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(word), shifts), _mm512_set1_epi32(3)),
                          base);
}

// MB x rows against one weight row: per tile the column indices and the kept values are made once
// and serve every x row (a batch's rows shared nothing before: each redid the index arithmetic and
// the int8 -> float conversion). Each x row keeps its own two chains (even tiles, odd tiles) and
// the same operations in the same order as alone, so its sums are the same bits whatever MB.
template <int MB, typename V>
__attribute__((target("avx512f"))) void dot_avx512(const V* v, const int32_t* meta, const float* x, int64_t xstride,
                                                   int64_t tiles, float* out) {
  __m512 acc0[MB], acc1[MB];
  for (int k = 0; k < MB; ++k) acc0[k] = acc1[k] = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 2 <= tiles; t += 2) {  // two chains: the FMA latency stays hidden behind the loads
    const char* ahead = reinterpret_cast<const char*>(v + t * kKept) + kAhead;
    _mm_prefetch(ahead, _MM_HINT_T0);
    if constexpr (sizeof(V) == 4) _mm_prefetch(ahead + 64, _MM_HINT_T0);  // float: two tiles are two lines
    const __m512i i0 = columns16(meta[t]), i1 = columns16(meta[t + 1]);
    const __m512 w0 = values16(v + t * kKept), w1 = values16(v + (t + 1) * kKept);
    for (int k = 0; k < MB; ++k) {
      const float* x0 = x + k * xstride + t * kTile;
      const __m512 a = _mm512_permutex2var_ps(_mm512_loadu_ps(x0), i0, _mm512_loadu_ps(x0 + 16));
      const __m512 b = _mm512_permutex2var_ps(_mm512_loadu_ps(x0 + 32), i1, _mm512_loadu_ps(x0 + 48));
      acc0[k] = _mm512_fmadd_ps(w0, a, acc0[k]);
      acc1[k] = _mm512_fmadd_ps(w1, b, acc1[k]);
    }
  }
  if (t < tiles) {
    const __m512i i0 = columns16(meta[t]);
    const __m512 w0 = values16(v + t * kKept);
    for (int k = 0; k < MB; ++k) {
      const float* x0 = x + k * xstride + t * kTile;
      acc0[k] = _mm512_fmadd_ps(w0, _mm512_permutex2var_ps(_mm512_loadu_ps(x0), i0, _mm512_loadu_ps(x0 + 16)), acc0[k]);
    }
  }
  for (int k = 0; k < MB; ++k) out[k] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[k], acc1[k]));
}

using brisk_simd::hsum8;

template <typename V>
__attribute__((target("avx2,fma"))) inline __m256 values8(const V* v) {
  if constexpr (std::is_same_v<V, float>) return _mm256_loadu_ps(v);
  else return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v))));
}

// x as dot_avx2 reads it: each 16 columns reordered [0-3, 8-11, 4-7, 12-15], so that the first 8
// hold groups 0 and 2 and the next 8 groups 1 and 3, each group in the 128-bit half its kept values'
// lanes are in (below).
void avx2_order(const float* x, int64_t n, float* out) {
  for (int64_t c = 0; c < n; c += 16)
    for (int q = 0; q < 4; ++q) std::copy(x + c + 4 * q, x + c + 4 * q + 4, out + c + 4 * ((q & 1) * 2 + (q >> 1)));
}

// Half a tile: 16 columns, 8 kept values, 16 meta bits. Kept value k (lane k) belongs to group k / 2:
// lanes 0-1 to columns 0-3 and lanes 4-5 to columns 8-11, which avx2_order put in the low and high
// 128 bits of the first vector; lanes 2-3 (columns 4-7) and 6-7 (12-15) in the second. So one
// in-lane permute of each (vpermilps reads only an index's low 2 bits: the column within its
// group, as the meta holds it) and a constant blend pick the 8 values: ~8 instructions a half tile
// where a lane-crossing permute of each half, index arithmetic and a variable blend took ~13 (an
// AVX2 Zen 3 was compute-bound on them). Each lane's products and sums are as before: same bits.
// MB x rows at once as dot_avx512: the shifted meta words and the kept values made once a tile.
template <int MB, typename V>
__attribute__((target("avx2,fma"))) void dot_avx2(const V* v, const int32_t* meta, const float* x, int64_t xstride,
                                                  int64_t tiles, float* out) {
  const __m256i lo = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14), hi = _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30);
  __m256 acc0[MB], acc1[MB];
  for (int k = 0; k < MB; ++k) acc0[k] = acc1[k] = _mm256_setzero_ps();
  for (int64_t t = 0; t < tiles; ++t) {
    _mm_prefetch(reinterpret_cast<const char*>(v + t * kKept) + kAhead, _MM_HINT_T0);
    const __m256i word = _mm256_set1_epi32(meta[t]);
    const __m256i i0 = _mm256_srlv_epi32(word, lo), i1 = _mm256_srlv_epi32(word, hi);
    const __m256 w0 = values8(v + t * kKept), w1 = values8(v + t * kKept + 8);
    for (int k = 0; k < MB; ++k) {
      const float* xt = x + k * xstride + t * kTile;
      const __m256 x0 = _mm256_blend_ps(_mm256_permutevar_ps(_mm256_loadu_ps(xt), i0),
                                        _mm256_permutevar_ps(_mm256_loadu_ps(xt + 8), i0), 0xCC);
      const __m256 x1 = _mm256_blend_ps(_mm256_permutevar_ps(_mm256_loadu_ps(xt + 16), i1),
                                        _mm256_permutevar_ps(_mm256_loadu_ps(xt + 24), i1), 0xCC);
      acc0[k] = _mm256_fmadd_ps(w0, x0, acc0[k]);
      acc1[k] = _mm256_fmadd_ps(w1, x1, acc1[k]);
    }
  }
  for (int k = 0; k < MB; ++k) out[k] = hsum8(_mm256_add_ps(acc0[k], acc1[k]));
}
#endif

// y[k] for MB x rows (x + k * xstride) against one weight row.
template <int MB, typename V>
void dot(const V* v, const int32_t* meta, const float* x, int64_t xstride, int64_t tiles, float* out) {
#ifdef BRISK_X86
  if (brisk_isa::avx512()) return dot_avx512<MB>(v, meta, x, xstride, tiles, out);
  if (brisk_isa::at_least_avx2()) return dot_avx2<MB>(v, meta, x, xstride, tiles, out);
#endif
  for (int k = 0; k < MB; ++k) out[k] = dot_scalar(v, meta, x + k * xstride, tiles);
}

// x rows [m, in] as [m, tiles * 32], zero-padded where `in` is not whole tiles (the kernels read
// whole tiles); `x` itself when it is.
const float* padded(const float* x, int64_t m, int64_t in, int64_t tiles, std::vector<float>& buf) {
  if (in == tiles * kTile) return x;
  buf.assign(m * tiles * kTile, 0.f);
  for (int64_t k = 0; k < m; ++k) std::copy(x + k * in, x + (k + 1) * in, buf.begin() + k * tiles * kTile);
  return buf.data();
}

template <typename V>
void rows_of(const V* values, const int32_t* meta, const float* x, float* y, int64_t m, int64_t out, int64_t in,
             int64_t r0, int64_t r1) {
  const int64_t tiles = (in + kTile - 1) / kTile;
  thread_local std::vector<float> buf, ordered;
  const float* xp = padded(x, m, in, tiles, buf);
#ifdef BRISK_X86
  if (!brisk_isa::avx512() && brisk_isa::at_least_avx2()) {  // dot_avx2 reads x reordered
    ordered.resize(m * tiles * kTile);
    avx2_order(xp, m * tiles * kTile, ordered.data());
    xp = ordered.data();
  }
#endif
  const int64_t xs = tiles * kTile;
  for (int64_t r = r0; r < r1; ++r) {
    const V* v = values + r * tiles * kKept;
    const int32_t* mr = meta + r * tiles;
    float t[4];
    int64_t k = 0;
    for (; k + 4 <= m; k += 4) {  // x rows four at a time (AVX2's 16 registers hold 4 rows' chains)
      dot<4>(v, mr, xp + k * xs, xs, tiles, t);
      for (int j = 0; j < 4; ++j) y[(k + j) * out + r] = t[j];
    }
    for (; k < m; ++k) dot<1>(v, mr, xp + k * xs, xs, tiles, y + k * out + r);
  }
}

void check(const torch::Tensor& values, const torch::Tensor& meta, int64_t in) {
  const int64_t tiles = (in + kTile - 1) / kTile;
  TORCH_CHECK(values.device().is_cpu() && meta.device().is_cpu() && values.is_contiguous() && meta.is_contiguous() &&
                  (values.scalar_type() == torch::kFloat32 || values.scalar_type() == torch::kInt8) &&
                  meta.scalar_type() == torch::kInt32 && values.dim() == 2 && meta.dim() == 2 &&
                  values.size(0) == meta.size(0) && values.size(1) == tiles * kKept && meta.size(1) == tiles &&
                  in % 4 == 0,
              "brisk sparse24: values [out, ", tiles * kKept, "] float32 or int8 and meta [out, ", tiles,
              "] int32 (contiguous CPU) for ", in, " input columns (a multiple of 4)");
}

}  // namespace

namespace brisk_range {
void sparse24_rows(const torch::Tensor& values, const int32_t* meta, const float* x, float* y, int64_t m, int64_t out,
                   int64_t in, int64_t r0, int64_t r1) {
  if (values.scalar_type() == torch::kInt8)
    rows_of(values.data_ptr<int8_t>(), meta, x, y, m, out, in, r0, r1);
  else
    rows_of(values.data_ptr<float>(), meta, x, y, m, out, in, r0, r1);
}
}  // namespace brisk_range

// x [M, in] @ W^T, W 2:4 sparse in the layout above; int8 values times scale [out]; + bias.
// The epilogue multiplies, then adds: the decode plan's order (cpu_decode_plan.cpp LinearOp::rows).
torch::Tensor sparse24_gemm(const torch::Tensor& x, const torch::Tensor& values, const torch::Tensor& meta,
                            const c10::optional<torch::Tensor>& scale, const c10::optional<torch::Tensor>& bias,
                            int64_t in) {
  check(values, meta, in);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in && x.device().is_cpu(), "brisk sparse24_gemm: x must be CPU [M, ", in, "]");
  const bool int8 = values.scalar_type() == torch::kInt8;
  TORCH_CHECK(int8 == scale.has_value(), "brisk sparse24_gemm: int8 values need a scale, float values none");
  const auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t m = xf.size(0), out = values.size(0);
  auto y = torch::empty({m, out}, xf.options());
  torch::Tensor s, b;
  if (scale.has_value()) s = scale->to(torch::kFloat32).contiguous();
  if (bias.has_value()) b = bias->to(torch::kFloat32).contiguous();
  TORCH_CHECK((!s.defined() || s.numel() == out) && (!b.defined() || b.numel() == out),
              "brisk sparse24_gemm: scale and bias have one value per output row");
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int32_t* mp = meta.data_ptr<int32_t>();
  const int64_t units = (out + brisk_range::kRowUnit - 1) / brisk_range::kRowUnit;
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    const int64_t r0 = u0 * brisk_range::kRowUnit, r1 = std::min(out, u1 * brisk_range::kRowUnit);
    brisk_range::sparse24_rows(values, mp, xp, yp, m, out, in, r0, r1);
    if (!s.defined() && !b.defined()) return;
    for (int64_t k = 0; k < m; ++k)
      for (int64_t r = r0; r < r1; ++r) {
        float& v = yp[k * out + r];
        if (s.defined()) v *= s.data_ptr<float>()[r];
        if (b.defined()) v += b.data_ptr<float>()[r];
      }
  });
  return y;
}

// The dense float32 weight [out, in] the sparse one stands for (int8 values times their scale):
// batched prefill rows multiply it through oneDNN, the torch fallback and the tests read it.
torch::Tensor sparse24_dense(const torch::Tensor& values, const torch::Tensor& meta,
                             const c10::optional<torch::Tensor>& scale, int64_t in) {
  check(values, meta, in);
  const int64_t out = values.size(0), tiles = meta.size(1);
  auto w = torch::zeros({out, tiles * kTile}, values.options().dtype(torch::kFloat32));
  const torch::Tensor vf = values.to(torch::kFloat32).contiguous();
  torch::Tensor s;
  if (scale.has_value()) s = scale->to(torch::kFloat32).contiguous();
  const float* vp = vf.data_ptr<float>();
  const int32_t* mp = meta.data_ptr<int32_t>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, out, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float sc = s.defined() ? s.data_ptr<float>()[r] : 1.f;
      for (int64_t t = 0; t < tiles; ++t) {
        const uint32_t m = static_cast<uint32_t>(mp[r * tiles + t]);
        for (int k = 0; k < kKept; ++k) {
          const int64_t col = t * kTile + 4 * (k >> 1) + ((m >> (2 * k)) & 3);
          wp[r * tiles * kTile + col] = vp[(r * tiles + t) * kKept + k] * sc;
        }
      }
    }
  });
  return in == tiles * kTile ? w : w.narrow(1, 0, in).contiguous();
}
