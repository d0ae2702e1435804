// RMSNorm, SwiGLU's silu(gate) * up and GeGLU's gelu(gate) * up for float32 rows on CPU. torch 2.13's F.rms_norm on CPU is
// a chain of small ops (pow, mean, add, rsqrt, two muls): ~28 us for one 576-wide decode row, 61
// times per token, 1.7 ms of a 12 ms int4 decode step. One pass over the row does the same in
// about a microsecond. The decode plan calls the row functions (brisk_range) directly.
//
// Three paths, chosen per call by brisk_isa: AVX-512, AVX2+FMA and portable C++. The sum of squares
// is reduced in each path's own lane order, so the three differ by float rounding (a few ulp of the
// norm, tested); silu's and gelu's exp is exact-to-an-ulp in the vector paths (the same steps on 16
// and 8 lanes: bit-identical) and std::exp in the portable one.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "kernels.h"
#include "simd.h"

namespace {

#ifdef BRISK_X86
__attribute__((target("avx512f"))) void norm_row(const float* x, const float* w, float* y, int64_t h, float eps) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= h; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  float ss = _mm512_reduce_add_ps(acc);
  for (; i < h; ++i) ss = std::fma(x[i], x[i], ss);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
  const __m512 vinv = _mm512_set1_ps(inv);
  for (i = 0; i + 16 <= h; i += 16)
    _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), vinv), _mm512_loadu_ps(w + i)));
  for (; i < h; ++i) y[i] = x[i] * inv * w[i];
}

// silu(g) * u = g * sigmoid(g) * u over a row; sigmoid from e = exp(-|g|) <= 1, so no exp overflows:
// 1 / (1 + e) for g >= 0, e / (1 + e) below.
__attribute__((target("avx512f"))) void silu_mul_row(const float* g, const float* u, float* y, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 e = brisk_simd::exp512_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), e, one);
    const __m512 sig = _mm512_div_ps(num, _mm512_add_ps(one, e));
    _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(x, sig), _mm512_loadu_ps(u + i)));
  }
  for (; i < n; ++i) {
    const float e = std::exp(-std::fabs(g[i]));
    y[i] = g[i] * ((g[i] >= 0.0f ? 1.0f : e) / (1.0f + e)) * u[i];
  }
}

// GELU with the tanh approximation, times up: 0.5 g (1 + tanh(z)) = g * sigmoid(2 z), with
// z = sqrt(2 / pi) (g + 0.044715 g^3): the sigmoid form has no cancellation near 0 and shares
// silu's overflow-free exp. Matches torch's gelu(approximate="tanh") to float rounding.
constexpr float kGeluC1 = 1.5957691216057308f;              // 2 sqrt(2 / pi)
constexpr float kGeluC2 = 1.5957691216057308f * 0.044715f;  // 2 sqrt(2 / pi) 0.044715

__attribute__((target("avx512f"))) void gelu_tanh_mul_row(const float* g, const float* u, float* y, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f), c1 = _mm512_set1_ps(kGeluC1), c2 = _mm512_set1_ps(kGeluC2);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 z2 = _mm512_mul_ps(x, _mm512_add_ps(c1, _mm512_mul_ps(c2, _mm512_mul_ps(x, x))));
    const __m512 e = brisk_simd::exp512_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(z2)));
    const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(z2, _mm512_setzero_ps(), _CMP_GE_OQ), e, one);
    const __m512 sig = _mm512_div_ps(num, _mm512_add_ps(one, e));
    _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(x, sig), _mm512_loadu_ps(u + i)));
  }
  for (; i < n; ++i) {
    const float z2 = g[i] * (kGeluC1 + kGeluC2 * (g[i] * g[i]));
    const float e = std::exp(-std::fabs(z2));
    y[i] = g[i] * ((z2 >= 0.0f ? 1.0f : e) / (1.0f + e)) * u[i];
  }
}

// silu_mul_row and gelu_tanh_mul_row on 8 lanes: the same operations (exp256_nonpositive is
// exp512_nonpositive's), so rows of whole 16-lane steps give the AVX-512 floats bit for bit.
template <bool Gelu>
__attribute__((target("avx2,fma"))) void act_mul_row_avx2(const float* g, const float* u, float* y, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps(), c1 = _mm256_set1_ps(kGeluC1),
               c2 = _mm256_set1_ps(kGeluC2);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 z = Gelu ? _mm256_mul_ps(x, _mm256_add_ps(c1, _mm256_mul_ps(c2, _mm256_mul_ps(x, x)))) : x;
    const __m256 e = brisk_simd::exp256_nonpositive(_mm256_sub_ps(zero, _mm256_and_ps(z, abs_mask)));
    const __m256 num = _mm256_blendv_ps(e, one, _mm256_cmp_ps(z, zero, _CMP_GE_OQ));
    const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) {
    const float z = Gelu ? g[i] * (kGeluC1 + kGeluC2 * (g[i] * g[i])) : g[i];
    const float e = std::exp(-std::fabs(z));
    y[i] = g[i] * ((z >= 0.0f ? 1.0f : e) / (1.0f + e)) * u[i];
  }
}

using brisk_simd::hsum8;

__attribute__((target("avx2,fma"))) void norm_row_avx2(const float* x, const float* w, float* y, int64_t h, float eps) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= h; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum8(acc);
  for (; i < h; ++i) ss = std::fma(x[i], x[i], ss);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
  const __m256 vinv = _mm256_set1_ps(inv);
  for (i = 0; i + 8 <= h; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv), _mm256_loadu_ps(w + i)));
  for (; i < h; ++i) y[i] = x[i] * inv * w[i];
}
#endif

void norm_row_portable(const float* x, const float* w, float* y, int64_t h, float eps) {
  float ss = 0.0f;
  for (int64_t i = 0; i < h; ++i) ss = std::fma(x[i], x[i], ss);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i) y[i] = x[i] * inv * w[i];
}

void silu_mul_row_portable(const float* g, const float* u, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float e = std::exp(-std::fabs(g[i]));
    y[i] = g[i] * ((g[i] >= 0.0f ? 1.0f : e) / (1.0f + e)) * u[i];
  }
}

void gelu_tanh_mul_row_portable(const float* g, const float* u, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float z2 = g[i] * (kGeluC1 + kGeluC2 * (g[i] * g[i]));
    const float e = std::exp(-std::fabs(z2));
    y[i] = g[i] * ((z2 >= 0.0f ? 1.0f : e) / (1.0f + e)) * u[i];
  }
}

// The row functions every entry point and the decode plan use, at the ISA in use.
void norm_row_any(const float* x, const float* w, float* y, int64_t h, float eps) {
#ifdef BRISK_X86
  if (brisk_isa::avx512()) return norm_row(x, w, y, h, eps);
  if (brisk_isa::active() == brisk_isa::Level::kAvx2) return norm_row_avx2(x, w, y, h, eps);
#endif
  norm_row_portable(x, w, y, h, eps);
}

void silu_mul_row_any(const float* g, const float* u, float* y, int64_t n) {
#ifdef BRISK_X86
  if (brisk_isa::avx512()) return silu_mul_row(g, u, y, n);
  if (brisk_isa::at_least_avx2()) return act_mul_row_avx2<false>(g, u, y, n);
#endif
  silu_mul_row_portable(g, u, y, n);
}

void gelu_tanh_mul_row_any(const float* g, const float* u, float* y, int64_t n) {
#ifdef BRISK_X86
  if (brisk_isa::avx512()) return gelu_tanh_mul_row(g, u, y, n);
  if (brisk_isa::at_least_avx2()) return act_mul_row_avx2<true>(g, u, y, n);
#endif
  gelu_tanh_mul_row_portable(g, u, y, n);
}

// Index of the first maximum of a row (torch.argmax's tie rule). Returns -1 when the row holds a
// NaN (torch ranks NaN highest; the caller asks torch then).
#ifdef BRISK_X86
__attribute__((target("avx512f"))) int64_t argmax_row_avx512(const float* x, int64_t n) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i at = _mm512_set1_epi32(-1), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= n && i + 16 <= (int64_t{1} << 31); i += 16, idx = _mm512_add_epi32(idx, step)) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 more = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strictly: the first one stays
    best = _mm512_mask_mov_ps(best, more, v);
    at = _mm512_mask_mov_epi32(at, more, idx);
  }
  if (nan) return -1;
  alignas(64) float bv[16];
  alignas(64) int32_t bi[16];
  _mm512_store_ps(bv, best);
  _mm512_store_si512(bi, at);
  float m = -std::numeric_limits<float>::infinity();
  int64_t arg = -1;
  for (int l = 0; l < 16; ++l)  // the lanes' maxima: the larger, then the earlier index
    if (bi[l] >= 0 && (bv[l] > m || (bv[l] == m && bi[l] < arg))) m = bv[l], arg = bi[l];
  if (arg < 0 && i > 0) arg = 0;  // the vectors held only -inf: the first of them
  for (; i < n; ++i) {
    if (std::isnan(x[i])) return -1;
    if (x[i] > m || arg < 0) m = x[i], arg = i;
  }
  return arg;
}
#endif

int64_t argmax_row(const float* x, int64_t n) {
#ifdef BRISK_X86
  if (brisk_isa::avx512()) return argmax_row_avx512(x, n);
#endif
  float m = -std::numeric_limits<float>::infinity();
  int64_t arg = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return -1;
    if (x[i] > m || arg < 0) m = x[i], arg = i;
  }
  return arg;
}

void check_rows(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "brisk ",
              what, ": x must be a contiguous float32 CPU [n, h]");
}

}  // namespace

// act(gate_up[:, :inter]) * gate_up[:, inter:] for float32 rows; act 0: silu, 1: gelu (tanh).
torch::Tensor act_mul(const torch::Tensor& gate_up, int64_t act) {
  check_rows(gate_up, "act_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "brisk act_mul: gate_up must hold gate and up halves");
  TORCH_CHECK(act == 0 || act == 1, "brisk act_mul: act must be 0 (silu) or 1 (gelu tanh)");
  const int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto y = torch::empty({n, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const auto row = act == 0 ? silu_mul_row_any : gelu_tanh_mul_row_any;
  auto rows = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) row(gp + r * 2 * inter, gp + r * 2 * inter + inter, yp + r * inter, inter);
  };
  if (n < 16) rows(0, n);  // decode: waking the thread pool costs more than the work
  else at::parallel_for(0, n, 16, rows);
  return y;
}

// silu(gate_up[:, :inter]) * gate_up[:, inter:] for float32 rows (model/layers.py silu_and_mul).
torch::Tensor silu_mul(const torch::Tensor& gate_up) { return act_mul(gate_up, 0); }

// The first maximum's index of every row of x [n, V] float32 (torch.argmax(x, -1) up to NaN rows,
// which come back as -1). One pass a row: torch's generic reduction reads ~1 GB/s here.
torch::Tensor argmax_rows(const torch::Tensor& x) {
  check_rows(x, "argmax_rows");
  const int64_t n = x.size(0), v = x.size(1);
  auto out = torch::empty({n}, x.options().dtype(torch::kInt64));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) op[r] = argmax_row(xp + r * v, v);
  return out;
}

// Structured outputs: logits [n, V] float32, in place, set to -inf wherever bit t % 32 of
// bitmask[r, t / 32] (int32 [n, words], llguidance's layout) is clear, and past 32 * words. A
// grammar's mask is mostly whole words of 0 (forbidden) with a few set bits; torch's unpack and
// masked_fill take ~2 ms for 16 rows of 49k tokens, one pass here a fraction of that. Plain C++
// for every CPU (the all-forbidden runs are simple stores the compiler vectorises).
void apply_token_bitmask_(torch::Tensor& logits, const torch::Tensor& bitmask) {
  check_rows(logits, "apply_token_bitmask_");
  TORCH_CHECK(bitmask.scalar_type() == torch::kInt32 && bitmask.dim() == 2 && bitmask.is_contiguous() &&
                  bitmask.size(0) == logits.size(0) && bitmask.device().is_cpu(),
              "brisk apply_token_bitmask_: bitmask must be contiguous int32 [rows, words] on the CPU");
  const int64_t n = logits.size(0), v = logits.size(1), words = bitmask.size(1);
  const float ninf = -std::numeric_limits<float>::infinity();
  float* lp = logits.data_ptr<float>();
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  for (int64_t r = 0; r < n; ++r) {
    float* row = lp + r * v;
    const uint32_t* bits = bp + r * words;
    for (int64_t w = 0; w * 32 < v; ++w) {
      const uint32_t word = w < words ? bits[w] : 0u;
      if (word == 0xFFFFFFFFu) continue;
      float* out = row + w * 32;
      const int64_t m = std::min<int64_t>(32, v - w * 32);
      if (word == 0u) {
        for (int64_t j = 0; j < m; ++j) out[j] = ninf;
      } else {  // branchless, so the compiler vectorises it as a blend
        for (int64_t j = 0; j < m; ++j) out[j] = ((word >> j) & 1u) ? out[j] : ninf;
      }
    }
  }
}

// y = x / sqrt(mean(x^2) + eps) * w over the last dimension; x [n, h], w [h], float32.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.numel() == x.size(1),
              "brisk rms_norm: w must be float32 [h]");
  auto y = torch::empty_like(x);
  const int64_t n = x.size(0), h = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  auto rows = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row_any(xp + r * h, wp, yp + r * h, h, static_cast<float>(eps));
  };
  if (n < 64) rows(0, n);  // decode: waking the thread pool costs more than the work
  else at::parallel_for(0, n, 64, rows);
  return y;
}

namespace brisk_range {

void rms_norm_row(const float* x, const float* w, float* y, int64_t h, float eps) { norm_row_any(x, w, y, h, eps); }

void silu_mul_row(const float* g, const float* u, float* y, int64_t n) { silu_mul_row_any(g, u, y, n); }

void gelu_tanh_mul_row(const float* g, const float* u, float* y, int64_t n) { gelu_tanh_mul_row_any(g, u, y, n); }

}  // namespace brisk_range
