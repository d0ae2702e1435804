// W8A8: int8 activations x int8 weights -> int32, for decode-sized batches (quant/w8a8.py).
//
// Each row of x is quantized on the fly, symmetric per token: a = max|x| / 127, xq = round(x / a).
// AVX512-VNNI's vpdpbusd multiplies unsigned by signed bytes, 64 products per instruction, so xq
// is stored offset by 128 as uint8 and the offset is taken back out with the weight row sums:
//   sum_k (xq + 128) w = sum_k xq w + 128 sum_k w.
// Integer sums are exact, so results do not depend on the batch or the summation order.
//   y[m, n] = a[m] * s[n] * (acc[m, n] - 128 * wsum[n]) (+ bias[n])
// The same integers on every level: AVX-VNNI's 256-bit vpdpbusd; plain AVX2 as |w| x (q with w's
// sign) through vpmaddubsw (q = xq - 128 in [-127, 127]: pair sums <= 2 x 128 x 127, no saturation,
// which u8 x s8 pairs would reach) plus 128 x sum(w); the portable loop.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "simd.h"

namespace {

#ifdef BRISK_X86
bool cpu_has_vnni() { return brisk_isa::vnni(); }

// acc rows [m0, m0 + MB) x weight rows [r, r + R), K a multiple of 64.
template <int MB, int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void tile(const uint8_t* xq, const int8_t* w,
                                                                        int32_t* acc, int64_t k_dim, int64_t n,
                                                                        int64_t m0, int64_t r) {
  __m512i s[R][MB];
  for (int j = 0; j < R; ++j)
    for (int k = 0; k < MB; ++k) s[j][k] = _mm512_setzero_si512();
  for (int64_t i = 0; i < k_dim; i += 64) {
    for (int j = 0; j < R; ++j) {
      const int8_t* row = w + (r + j) * k_dim + i;
      _mm_prefetch(reinterpret_cast<const char*>(row + 2 * R * k_dim), _MM_HINT_T0);
      const __m512i wv = _mm512_loadu_si512(row);
      for (int k = 0; k < MB; ++k)
        s[j][k] = _mm512_dpbusd_epi32(s[j][k], _mm512_loadu_si512(xq + (m0 + k) * k_dim + i), wv);
    }
  }
  for (int j = 0; j < R; ++j)
    for (int k = 0; k < MB; ++k) acc[(m0 + k) * n + r + j] = _mm512_reduce_add_epi32(s[j][k]);
}

using brisk_simd::hsum_epi32;

// tile on 256-bit vectors with AVX-VNNI's vpdpbusd (AVX2's 16 registers: R x MB <= 8).
template <int MB, int R>
__attribute__((target("avx2,avxvnni"))) inline void tile_avx_vnni(const uint8_t* xq, const int8_t* w, int32_t* acc,
                                                                 int64_t k_dim, int64_t n, int64_t m0, int64_t r) {
  __m256i s[R][MB];
  for (int j = 0; j < R; ++j)
    for (int k = 0; k < MB; ++k) s[j][k] = _mm256_setzero_si256();
  for (int64_t i = 0; i < k_dim; i += 32) {
    for (int j = 0; j < R; ++j) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (r + j) * k_dim + i));
      for (int k = 0; k < MB; ++k)
        s[j][k] = _mm256_dpbusd_avx_epi32(
            s[j][k], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (m0 + k) * k_dim + i)), wv);
    }
  }
  for (int j = 0; j < R; ++j)
    for (int k = 0; k < MB; ++k) acc[(m0 + k) * n + r + j] = hsum_epi32(s[j][k]);
}

// tile on plain AVX2: sum (xq - 128) w through vpmaddubsw with the sign moved onto x, and
// 128 sum w from the weight alone (shared by the MB rows of x).
template <int MB, int R>
__attribute__((target("avx2"))) inline void tile_avx2(const uint8_t* xq, const int8_t* w, int32_t* acc, int64_t k_dim,
                                                     int64_t n, int64_t m0, int64_t r) {
  const __m256i ones16 = _mm256_set1_epi16(1), ones8 = _mm256_set1_epi8(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256i s[R][MB], ws[R];
  for (int j = 0; j < R; ++j) {
    ws[j] = _mm256_setzero_si256();
    for (int k = 0; k < MB; ++k) s[j][k] = _mm256_setzero_si256();
  }
  for (int64_t i = 0; i < k_dim; i += 32) {
    for (int j = 0; j < R; ++j) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (r + j) * k_dim + i));
      const __m256i wabs = _mm256_abs_epi8(wv);
      ws[j] = _mm256_add_epi32(ws[j], _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, wv), ones16));
      for (int k = 0; k < MB; ++k) {
        const __m256i q = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (m0 + k) * k_dim + i)), flip);
        s[j][k] = _mm256_add_epi32(
            s[j][k], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(q, wv)), ones16));
      }
    }
  }
  for (int j = 0; j < R; ++j) {
    const int32_t w128 = 128 * hsum_epi32(ws[j]);
    for (int k = 0; k < MB; ++k) acc[(m0 + k) * n + r + j] = hsum_epi32(s[j][k]) + w128;
  }
}

// Which tile kernel: 0 AVX512-VNNI, 1 AVX-VNNI, 2 AVX2.
template <int Path, int MB, int R>
inline void tile_of(const uint8_t* xq, const int8_t* w, int32_t* acc, int64_t k_dim, int64_t n, int64_t m0, int64_t r) {
  if constexpr (Path == 0) tile<MB, R>(xq, w, acc, k_dim, n, m0, r);
  else if constexpr (Path == 1) tile_avx_vnni<MB, R>(xq, w, acc, k_dim, n, m0, r);
  else tile_avx2<MB, R>(xq, w, acc, k_dim, n, m0, r);
}

template <int Path, int MB, int R>
void rows(const uint8_t* xq, const int8_t* w, int32_t* acc, int64_t k_dim, int64_t n, int64_t m0, int64_t r0,
          int64_t r1) {
  int64_t r = r0;
  for (; r + R <= r1; r += R) tile_of<Path, MB, R>(xq, w, acc, k_dim, n, m0, r);
  for (; r < r1; ++r) tile_of<Path, MB, 1>(xq, w, acc, k_dim, n, m0, r);
}
#endif

// The portable loop: the same integer sums.
void rows_portable(const uint8_t* xq, const int8_t* w, int32_t* acc, int64_t k_dim, int64_t n, int64_t m, int64_t r0,
                   int64_t r1) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t k = 0; k < m; ++k) {
      int32_t sum = 0;
      for (int64_t i = 0; i < k_dim; ++i) sum += static_cast<int32_t>(xq[k * k_dim + i]) * w[r * k_dim + i];
      acc[k * n + r] = sum;
    }
}

}  // namespace

namespace {
// One row: a = max|x| / 127 (1 for an all-zero row), q = round(x / a) in [-127, 127], plus
// `offset` (128 for the VNNI kernel's uint8, 0 for int8). A division, not a multiply by 1 / a
// (two roundings): the same integers as the torch path's torch.round(x / a), whichever path.
inline uint8_t quantize_value(float x, float scale, int offset) {
  const float q = std::nearbyint(x / scale);  // round half to even, as torch.round
  return static_cast<uint8_t>(static_cast<int>(std::clamp(q, -127.f, 127.f)) + offset);
}

#ifdef BRISK_X86
// The same integers as the scalar loop below, 16 at a time: the division is IEEE in both, and
// roundscale's nearest-int is nearbyint's round-half-even. It was a scalar libm call per element,
// 13% of a batched w8a8 run.
__attribute__((target("avx512f"))) void quantize_row_avx512(const float* row, uint8_t* out, int64_t k, int offset,
                                                            float* a) {
  __m512 m = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(row + i)), m);
  float amax = _mm512_reduce_max_ps(m);
  for (; i < k; ++i) amax = std::max(amax, std::fabs(row[i]));
  const float scale = amax > 0.f ? amax / 127.f : 1.f;
  const __m512 s = _mm512_set1_ps(scale);
  const __m512i off = _mm512_set1_epi32(offset);
  for (i = 0; i + 16 <= k; i += 16) {
    const __m512i q = brisk_simd::round_clamp(_mm512_div_ps(_mm512_loadu_ps(row + i), s), 127);
    const __m512i v = _mm512_add_epi32(q, off);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(v));
  }
  for (; i < k; ++i) out[i] = quantize_value(row[i], scale, offset);
  *a = scale;
}

// quantize_row_avx512 on 8 lanes: the same integers (the max's order does not matter, the division
// is IEEE, vroundps's nearest-int is round-half-even).
__attribute__((target("avx2,fma"))) void quantize_row_avx2(const float* row, uint8_t* out, int64_t k, int offset,
                                                          float* a) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(row + i), abs_mask), m);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float amax = 0.f;
  for (float v : lanes) amax = std::max(amax, v);
  for (; i < k; ++i) amax = std::max(amax, std::fabs(row[i]));
  const float scale = amax > 0.f ? amax / 127.f : 1.f;
  const __m256 s = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  const __m256i off = _mm256_set1_epi32(offset);
  for (i = 0; i + 8 <= k; i += 8) {
    const __m256 r =
        _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(row + i), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i v = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi)), off);
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    // values in [1, 255] with the offset (unsigned saturation keeps them), [-127, 127] without
    const __m128i bytes = offset ? _mm_packus_epi16(w16, w16) : _mm_packs_epi16(w16, w16);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), bytes);
  }
  for (; i < k; ++i) out[i] = quantize_value(row[i], scale, offset);
  *a = scale;
}
#endif

void quantize_row(const float* row, uint8_t* out, int64_t k, int offset, float* a) {
#ifdef BRISK_X86
  if (brisk_isa::avx512()) return quantize_row_avx512(row, out, k, offset, a);
  if (brisk_isa::at_least_avx2()) return quantize_row_avx2(row, out, k, offset, a);
#endif
  float amax = 0.f;
  for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(row[i]));
  const float scale = amax > 0.f ? amax / 127.f : 1.f;
  for (int64_t i = 0; i < k; ++i) out[i] = quantize_value(row[i], scale, offset);
  *a = scale;
}
}  // namespace

// Per-token symmetric int8 quantization of x [M, K] float: (q [M, K], a [M]); q is uint8 holding
// q + 128 when `unsigned_offset` (the VNNI kernel's input), else int8 (torch._int_mm's).
std::tuple<torch::Tensor, torch::Tensor> quantize_rows(const torch::Tensor& x, bool unsigned_offset) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "brisk quantize_rows: x must be a 2-D CPU tensor");
  auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t m = xf.size(0), k = xf.size(1);
  auto xq = torch::empty({m, k}, xf.options().dtype(unsigned_offset ? torch::kUInt8 : torch::kInt8));
  auto a = torch::empty({m}, xf.options());
  const float* xp = xf.data_ptr<float>();
  auto* qp = static_cast<uint8_t*>(xq.data_ptr());
  float* ap = a.data_ptr<float>();
  at::parallel_for(0, m, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row(xp + r * k, qp + r * k, k, unsigned_offset ? 128 : 0, ap + r);
  });
  return {xq, a};
}

// y[m, n] = (acc[m, n] * s[n]) * a[m] (+ bias[n]) in float32, multiplied in that order: oneDNN's
// packed int8 matmul gives exactly acc * s, and the torch fallback uses the same order, so every
// path gives the same floats.
torch::Tensor int8_epilogue(const torch::Tensor& acc, const torch::Tensor& a, const torch::Tensor& s,
                            const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(acc.scalar_type() == torch::kInt32 && acc.dim() == 2 && acc.is_contiguous() && acc.device().is_cpu(),
              "brisk int8_epilogue: acc must be a contiguous int32 CPU [M, N]");
  const int64_t m = acc.size(0), n = acc.size(1);
  TORCH_CHECK(a.scalar_type() == torch::kFloat32 && a.numel() == m && s.scalar_type() == torch::kFloat32 &&
                  s.numel() == n && a.is_contiguous() && s.is_contiguous(),
              "brisk int8_epilogue: a [M] and s [N] must be contiguous float32");
  auto y = torch::empty({m, n}, a.options());
  const int32_t* ip = acc.data_ptr<int32_t>();
  const float* ap = a.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  torch::Tensor b;
  if (bias.has_value()) b = bias->to(torch::kFloat32).contiguous();
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < n; ++c) {
        const float v = static_cast<float>(ip[r * n + c]) * sp[c] * ap[r];
        yp[r * n + c] = bp ? v + bp[c] : v;
      }
  });
  return y;
}

// acc[M, N] int32 = sum_k xq_u8[m, k] * w[n, k]; xq from quantize_rows_u8, w int8 [N, K], K % 64 == 0.
torch::Tensor int8_dot_u8s8(const torch::Tensor& xq, const torch::Tensor& w) {
  TORCH_CHECK(xq.device().is_cpu() && w.device().is_cpu(), "brisk int8_dot_u8s8: CPU tensors only");
  TORCH_CHECK(xq.scalar_type() == torch::kUInt8 && w.scalar_type() == torch::kInt8 && xq.dim() == 2 && w.dim() == 2 &&
                  xq.is_contiguous() && w.is_contiguous() && xq.size(1) == w.size(1) && w.size(1) % 64 == 0,
              "brisk int8_dot_u8s8: uint8 [M, K] and contiguous int8 [N, K] with K a multiple of 64");
  const int64_t m = xq.size(0), k = xq.size(1), n = w.size(0);
  auto acc = torch::empty({m, n}, xq.options().dtype(torch::kInt32));
  const uint8_t* xp = xq.data_ptr<uint8_t>();
  const int8_t* wp = w.data_ptr<int8_t>();
  int32_t* ap = acc.data_ptr<int32_t>();
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
#ifdef BRISK_X86
    int64_t m0 = 0;
    if (cpu_has_vnni()) {
      for (; m0 + 8 <= m; m0 += 8) rows<0, 8, 2>(xp, wp, ap, k, n, m0, r0, r1);
      for (; m0 + 4 <= m; m0 += 4) rows<0, 4, 4>(xp, wp, ap, k, n, m0, r0, r1);
      for (; m0 < m; ++m0) rows<0, 1, 8>(xp, wp, ap, k, n, m0, r0, r1);
      return;
    }
    if (brisk_isa::avx_vnni()) {
      for (; m0 + 4 <= m; m0 += 4) rows<1, 4, 2>(xp, wp, ap, k, n, m0, r0, r1);
      for (; m0 < m; ++m0) rows<1, 1, 4>(xp, wp, ap, k, n, m0, r0, r1);
      return;
    }
    if (brisk_isa::at_least_avx2()) {
      for (; m0 + 4 <= m; m0 += 4) rows<2, 4, 2>(xp, wp, ap, k, n, m0, r0, r1);
      for (; m0 < m; ++m0) rows<2, 1, 4>(xp, wp, ap, k, n, m0, r0, r1);
      return;
    }
#endif
    rows_portable(xp, wp, ap, k, n, m, r0, r1);
  });
  return acc;
}

bool have_vnni() {
#ifdef BRISK_X86
  return cpu_has_vnni();
#else
  return false;
#endif
}
