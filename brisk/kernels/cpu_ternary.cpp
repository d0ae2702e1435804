// Ternary weights {-1, 0, +1} x a scale per output row (quant/ternary.py, BitNet b1.58), stored
// as two bit planes: plus[o, i / 8] and minus[o, i / 8], bit b of byte j = column 8 j + b, so two
// bytes of a plane are the AVX-512 lane mask of 16 columns. The product adds the x lanes whose
// weight is +1 and subtracts those whose weight is -1 (masked add/sub): no multiplication until
// the row's sum meets its scale. 2 bits per weight.
//
// Every level gives the AVX-512 floats: the AVX2 path holds each 16-lane accumulator as two 8-lane
// halves (a mask byte each, expanded to lanes; adding x & mask adds +0 where the bit is clear, as
// the masked add leaves the lane) and sums them in _mm512_reduce_add_ps's order; the portable loop
// keeps the 16 lanes and that order too.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>

#include "simd.h"

namespace {

#ifdef BRISK_X86
template <int MB>
__attribute__((target("avx512f"))) void rows(const uint8_t* plus, const uint8_t* minus, const float* x, float* y,
                                             int64_t in, int64_t out, int64_t m0, int64_t r0, int64_t r1) {
  const int64_t rb = in / 8;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* p = plus + r * rb;
    const uint8_t* n = minus + r * rb;
    __m512 acc[MB];
    for (int k = 0; k < MB; ++k) acc[k] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 16) {
      uint16_t pm, nm;
      std::memcpy(&pm, p + i / 8, 2);
      std::memcpy(&nm, n + i / 8, 2);
      for (int k = 0; k < MB; ++k) {
        const __m512 xv = _mm512_loadu_ps(x + (m0 + k) * in + i);
        acc[k] = _mm512_mask_add_ps(acc[k], static_cast<__mmask16>(pm), acc[k], xv);
        acc[k] = _mm512_mask_sub_ps(acc[k], static_cast<__mmask16>(nm), acc[k], xv);
      }
    }
    for (int k = 0; k < MB; ++k) y[(m0 + k) * out + r] = _mm512_reduce_add_ps(acc[k]);
  }
}

// 8 lanes all ones where bit i of `bits` is set.
__attribute__((target("avx2,fma"))) inline __m256 lane_mask(uint32_t bits) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), bit), bit));
}

template <int MB>
__attribute__((target("avx2,fma"))) void rows_avx2(const uint8_t* plus, const uint8_t* minus, const float* x, float* y,
                                                   int64_t in, int64_t out, int64_t m0, int64_t r0, int64_t r1) {
  const int64_t rb = in / 8;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* p = plus + r * rb;
    const uint8_t* n = minus + r * rb;
    __m256 acc[MB][2];  // the AVX-512 accumulator's lanes 0-7 and 8-15
    for (int k = 0; k < MB; ++k) acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < in; i += 16) {
      for (int h = 0; h < 2; ++h) {
        const __m256 pm = lane_mask(p[i / 8 + h]), nm = lane_mask(n[i / 8 + h]);
        for (int k = 0; k < MB; ++k) {
          const __m256 xv = _mm256_loadu_ps(x + (m0 + k) * in + i + 8 * h);
          acc[k][h] = _mm256_add_ps(acc[k][h], _mm256_and_ps(pm, xv));
          acc[k][h] = _mm256_sub_ps(acc[k][h], _mm256_and_ps(nm, xv));
        }
      }
    }
    for (int k = 0; k < MB; ++k) y[(m0 + k) * out + r] = brisk_simd::reduce_add16(acc[k][0], acc[k][1]);
  }
}
#endif

// One row of one x row on any CPU: 16 lane sums and the AVX-512 reduction's order.
void row_portable(const uint8_t* p, const uint8_t* n, const float* x, int64_t in, float* y) {
  float lane[16] = {};
  for (int64_t i = 0; i < in; i += 16)
    for (int j = 0; j < 16; ++j) {
      const int bit = (j & 7), byte = static_cast<int>(i / 8) + (j >> 3);
      if ((p[byte] >> bit) & 1) lane[j] = lane[j] + x[i + j];
      if ((n[byte] >> bit) & 1) lane[j] = lane[j] - x[i + j];
    }
  float t3[8], t6[4];
  for (int j = 0; j < 8; ++j) t3[j] = lane[8 + j] + lane[j];
  for (int j = 0; j < 4; ++j) t6[j] = t3[4 + j] + t3[j];
  *y = (t6[0] + t6[2]) + (t6[1] + t6[3]);
}

}  // namespace

// y[M, out] = (x[M, in] . T[out, in]^T) * scale[out] (+ bias), T ternary in two bit planes.
torch::Tensor ternary_gemm(const torch::Tensor& x, const torch::Tensor& plus, const torch::Tensor& minus,
                           const torch::Tensor& scale, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(plus.scalar_type() == torch::kUInt8 && minus.scalar_type() == torch::kUInt8 && plus.dim() == 2 &&
                  plus.sizes() == minus.sizes() && plus.is_contiguous() && minus.is_contiguous(),
              "brisk ternary_gemm: plus and minus must be contiguous uint8 [out, in / 8] of one shape");
  const int64_t out = plus.size(0), in = plus.size(1) * 8;
  TORCH_CHECK(in % 16 == 0, "brisk ternary_gemm: input features must be a multiple of 16");
  TORCH_CHECK(x.device().is_cpu() && plus.device().is_cpu() && minus.device().is_cpu() && scale.device().is_cpu(),
              "brisk ternary_gemm: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in, "brisk ternary_gemm: x does not fit the weight");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.numel() == out, "brisk ternary_gemm: scale must be float32 [out]");
  auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t m = xf.size(0);
  auto y = torch::empty({m, out}, xf.options());
  const uint8_t* pp = plus.data_ptr<uint8_t>();
  const uint8_t* np = minus.data_ptr<uint8_t>();
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out, 16, [&](int64_t r0, int64_t r1) {
#ifdef BRISK_X86
    if (brisk_isa::avx512()) {
      int64_t m0 = 0;
      for (; m0 + 8 <= m; m0 += 8) rows<8>(pp, np, xp, yp, in, out, m0, r0, r1);
      for (; m0 + 4 <= m; m0 += 4) rows<4>(pp, np, xp, yp, in, out, m0, r0, r1);
      for (; m0 < m; ++m0) rows<1>(pp, np, xp, yp, in, out, m0, r0, r1);
      return;
    }
    if (brisk_isa::at_least_avx2()) {  // 16 registers: 4 x rows' two halves at most
      int64_t m0 = 0;
      for (; m0 + 4 <= m; m0 += 4) rows_avx2<4>(pp, np, xp, yp, in, out, m0, r0, r1);
      for (; m0 < m; ++m0) rows_avx2<1>(pp, np, xp, yp, in, out, m0, r0, r1);
      return;
    }
#endif
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t k = 0; k < m; ++k)
        row_portable(pp + r * (in / 8), np + r * (in / 8), xp + k * in, in, yp + k * out + r);
  });
  y.mul_(scale.view({1, out}));
  if (bias.has_value()) y.add_(bias->to(torch::kFloat32));
  return y;
}
