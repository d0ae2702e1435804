// Matrix-vector products for single-token decode on CPU, streaming the weights at memory speed.
//
// Decoding one token reads every weight once, so decode speed is memory bandwidth. For a single
// row, torch's BLAS path (MKL sgemv on an [out, in] row-major weight) reaches about half of what
// these cores can stream. These kernels walk four output rows at a time, each 16 (AVX-512) or 8
// (AVX2) lanes wide, sharing every load of x across the four rows, and split the rows over
// torch's own thread pool. The instruction set is picked at run time, so one build serves any
// x86-64 CPU; other CPUs use the scalar loop. Results equal a float32-accumulated dot product up
// to summation order.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>

#include "isa.h"
#include "kernels.h"
#include "simd.h"

namespace {

constexpr int64_t kRows = 4;  // output rows per inner loop: x is loaded once for all four

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

// Portable fallback, also used for the last (out % 4) rows.
template <typename T>
void rows_scalar(const T* w, const T* x, float* y, int64_t r0, int64_t r1, int64_t in) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* row = w + r * in;
    float acc = 0.f;
    for (int64_t i = 0; i < in; ++i) acc += to_float(row[i]) * to_float(x[i]);
    y[r] = acc;
  }
}

#ifdef BRISK_X86
using brisk_simd::load16;
using brisk_simd::load8;

template <typename T>
__attribute__((target("avx512f"))) void rows_avx512(const T* w, const T* x, float* y, int64_t r0, int64_t r1,
                                                    int64_t in) {
  const int64_t vec_end = in - in % 16;
  int64_t r = r0;
  for (; r + kRows <= r1; r += kRows) {
    const T* a = w + r * in;
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
    for (int64_t i = 0; i < vec_end; i += 16) {
      // two groups ahead: see small_gemm_avx512
      for (int64_t k = 0; k < kRows; ++k) _mm_prefetch(reinterpret_cast<const char*>(a + (8 + k) * in + i), _MM_HINT_T0);
      const __m512 xv = load16(x + i);
      s0 = _mm512_fmadd_ps(load16(a + i), xv, s0);
      s1 = _mm512_fmadd_ps(load16(a + in + i), xv, s1);
      s2 = _mm512_fmadd_ps(load16(a + 2 * in + i), xv, s2);
      s3 = _mm512_fmadd_ps(load16(a + 3 * in + i), xv, s3);
    }
    float t[kRows] = {_mm512_reduce_add_ps(s0), _mm512_reduce_add_ps(s1), _mm512_reduce_add_ps(s2),
                      _mm512_reduce_add_ps(s3)};
    for (int64_t k = 0; k < kRows; ++k) {
      for (int64_t i = vec_end; i < in; ++i) t[k] = std::fma(to_float(a[k * in + i]), to_float(x[i]), t[k]);
      y[r + k] = t[k];
    }
  }
  // Leftover rows: the same one-accumulator order as the rows above (and as small_gemm), so a row's
  // result never depends on where the 4-row grouping happens to fall. Tails use explicit fma: left
  // to the compiler, `t += a * b` is contracted in some loops and not others.
  for (; r < r1; ++r) {
    const T* a = w + r * in;
    __m512 s0 = _mm512_setzero_ps();
    for (int64_t i = 0; i < vec_end; i += 16) s0 = _mm512_fmadd_ps(load16(a + i), load16(x + i), s0);
    float t = _mm512_reduce_add_ps(s0);
    for (int64_t i = vec_end; i < in; ++i) t = std::fma(to_float(a[i]), to_float(x[i]), t);
    y[r] = t;
  }
}

__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <typename T>
__attribute__((target("avx2,fma"))) void rows_avx2(const T* w, const T* x, float* y, int64_t r0, int64_t r1,
                                                   int64_t in) {
  const int64_t vec_end = in - in % 8;
  int64_t r = r0;
  for (; r + kRows <= r1; r += kRows) {
    const T* a = w + r * in;
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    for (int64_t i = 0; i < vec_end; i += 8) {
      const __m256 xv = load8(x + i);
      s0 = _mm256_fmadd_ps(load8(a + i), xv, s0);
      s1 = _mm256_fmadd_ps(load8(a + in + i), xv, s1);
      s2 = _mm256_fmadd_ps(load8(a + 2 * in + i), xv, s2);
      s3 = _mm256_fmadd_ps(load8(a + 3 * in + i), xv, s3);
    }
    float t[kRows] = {hsum8(s0), hsum8(s1), hsum8(s2), hsum8(s3)};
    for (int64_t k = 0; k < kRows; ++k) {
      for (int64_t i = vec_end; i < in; ++i) t[k] += to_float(a[k * in + i]) * to_float(x[i]);
      y[r + k] = t[k];
    }
  }
  rows_scalar(w, x, y, r, r1, in);
}
#endif

#ifdef BRISK_X86
// A few rows of x against the same weights (small decode batches, speculative verification): each
// block of four weight rows is read from memory once for all rows of x, and every (x row, weight
// row) dot product is summed in exactly the order rows_avx512 uses for a single row, so a token's
// result does not depend on how many other tokens share its batch.
//
// Micro-kernel: R weight rows (4, or 1 for the leftover rows) x MB rows of x (1..4), R * MB
// independent accumulators; x rows beyond four take further passes over the same weight rows,
// which are then in L1 (4 rows x `in` floats), so DRAM sees each weight once.
template <typename T, int R, int MB>
__attribute__((target("avx512f"))) inline void block_avx512(const T* a, const float* x, float* y, int64_t out,
                                                            int64_t in, int64_t vec_end, bool prefetch) {
  __m512 acc[R][MB];
  for (int j = 0; j < R; ++j)
    for (int k = 0; k < MB; ++k) acc[j][k] = _mm512_setzero_ps();
  for (int64_t i = 0; i < vec_end; i += 16) {
    if (prefetch)  // two blocks ahead, as rows_avx512 does
      for (int j = 0; j < R; ++j) _mm_prefetch(reinterpret_cast<const char*>(a + (8 + j) * in + i), _MM_HINT_T0);
    __m512 wv[R];
    for (int j = 0; j < R; ++j) wv[j] = load16(a + j * in + i);
    for (int k = 0; k < MB; ++k) {
      const __m512 xv = _mm512_loadu_ps(x + k * in + i);
      for (int j = 0; j < R; ++j) acc[j][k] = _mm512_fmadd_ps(wv[j], xv, acc[j][k]);
    }
  }
  for (int k = 0; k < MB; ++k) {
    for (int j = 0; j < R; ++j) {
      float t = _mm512_reduce_add_ps(acc[j][k]);
      for (int64_t i = vec_end; i < in; ++i) t = std::fma(to_float(a[j * in + i]), x[k * in + i], t);
      y[k * out + j] = t;
    }
  }
}

// All rows of x against weight rows [r, r + R): passes of up to four x rows.
template <typename T, int R>
__attribute__((target("avx512f"))) inline void block_rows_avx512(const T* a, const float* x, float* y,
                                                                 int64_t m_rows, int64_t out, int64_t in,
                                                                 int64_t vec_end) {
  int64_t m = 0;
  for (; m + 4 <= m_rows; m += 4) block_avx512<T, R, 4>(a, x + m * in, y + m * out, out, in, vec_end, m == 0);
  switch (m_rows - m) {
    case 3: block_avx512<T, R, 3>(a, x + m * in, y + m * out, out, in, vec_end, m == 0); break;
    case 2: block_avx512<T, R, 2>(a, x + m * in, y + m * out, out, in, vec_end, m == 0); break;
    case 1: block_avx512<T, R, 1>(a, x + m * in, y + m * out, out, in, vec_end, m == 0); break;
    default: break;
  }
}

template <typename T>
__attribute__((target("avx512f"))) void small_gemm_avx512(const T* w, const float* x, float* y, int64_t m_rows,
                                                          int64_t out, int64_t r0, int64_t r1, int64_t in) {
  const int64_t vec_end = in - in % 16;
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) block_rows_avx512<T, 4>(w + r * in, x, y + r, m_rows, out, in, vec_end);
  for (; r < r1; ++r) block_rows_avx512<T, 1>(w + r * in, x, y + r, m_rows, out, in, vec_end);
}
#endif

template <typename T>
void rows(const T* w, const T* x, float* y, int64_t r0, int64_t r1, int64_t in) {
#ifdef BRISK_X86
  const brisk_isa::Level isa = brisk_isa::active();
  if (isa == brisk_isa::Level::kAvx512) return rows_avx512(w, x, y, r0, r1, in);
  if (isa == brisk_isa::Level::kAvx2) return rows_avx2(w, x, y, r0, r1, in);
#endif
  rows_scalar(w, x, y, r0, r1, in);
}

}  // namespace

// y[1, out] = x[1, in] @ w[out, in]^T (+ bias), float32 or bfloat16, accumulated in float32.
torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "brisk gemv: CPU tensors only");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "brisk gemv: weight must be a contiguous [out, in] matrix");
  TORCH_CHECK(x.numel() == w.size(1), "brisk gemv: x has ", x.numel(), " elements, weight expects ", w.size(1));
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "brisk gemv: x and weight dtypes differ");
  const int64_t out = w.size(0), in = w.size(1);
  auto xc = x.contiguous();
  auto y = torch::empty({1, out}, x.options().dtype(torch::kFloat32));
  float* yp = y.data_ptr<float>();
  // Blocks of whole 4-row groups per task; a grain of 64 rows keeps tasks worth scheduling.
  const int64_t groups = (out + kRows - 1) / kRows;
  auto run = [&](auto* wp, auto* xp) {
    at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
      rows(wp, xp, yp, g0 * kRows, std::min(out, g1 * kRows), in);
    });
  };
  if (w.scalar_type() == torch::kFloat32) {
    run(w.data_ptr<float>(), xc.data_ptr<float>());
  } else if (w.scalar_type() == torch::kBFloat16) {
    run(w.data_ptr<c10::BFloat16>(), xc.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(false, "brisk gemv: float32 or bfloat16 only, got ", w.scalar_type());
  }
  if (bias.has_value()) y.add_(bias->to(torch::kFloat32));
  return w.scalar_type() == torch::kFloat32 ? y : y.to(w.scalar_type());
}

namespace {
// The row loop shared by small_gemm and int8_gemm: output rows split over threads in whole blocks
// of four (as gemv splits them, so every row is summed exactly as gemv sums it).
template <typename T>
void small_gemm_rows(const T* wp, const float* xp, float* yp, int64_t m_rows, int64_t out, int64_t in) {
  const int64_t groups = (out + kRows - 1) / kRows;
  at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
    small_gemm_avx512<T>(wp, xp, yp, m_rows, out, g0 * kRows, std::min(out, g1 * kRows), in);
  });
}
}  // namespace

// y[M, out] = x[M, in] @ w[out, in]^T (+ bias) for small M (decode batches): weights streamed once.
// Only with AVX-512 (callers check `small_gemm_supported`); per row identical to `gemv`.
torch::Tensor small_gemm(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(brisk_isa::avx512(), "brisk small_gemm: needs AVX-512");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && x.dim() == 2 && x.size(1) == w.size(1),
              "brisk small_gemm: shapes do not fit");
  const int64_t m_rows = x.size(0), out = w.size(0), in = w.size(1);
  auto xf = x.to(torch::kFloat32).contiguous();  // rows of x are reused from cache; float once
  auto y = torch::empty({m_rows, out}, x.options().dtype(torch::kFloat32));
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  auto run = [&](auto* wp) { small_gemm_rows(wp, xp, yp, m_rows, out, in); };
  if (w.scalar_type() == torch::kFloat32) {
    run(w.data_ptr<float>());
  } else if (w.scalar_type() == torch::kBFloat16) {
    run(w.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(false, "brisk small_gemm: float32 or bfloat16 only");
  }
  if (bias.has_value()) y.add_(bias->to(torch::kFloat32));
  return w.scalar_type() == torch::kFloat32 ? y : y.to(w.scalar_type());
}

std::string isa_name() { return brisk_isa::name(brisk_isa::active()); }

// y[M, out] = (x[M, in] @ q[out, in]^T) * scale[out] (+ bias): int8 weights with one float32 scale
// per output row (quant/int8.py), read at a quarter of float32's bytes and widened in registers.
// Any M; decode batches are what it is for (prefill dequantizes and uses a GEMM instead).
torch::Tensor int8_gemm(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                        const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(brisk_isa::avx512(), "brisk int8_gemm: needs AVX-512");
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.dim() == 2 && q.is_contiguous(), "brisk int8_gemm: q must be a contiguous int8 [out, in]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == q.size(1), "brisk int8_gemm: x does not fit q");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.numel() == q.size(0), "brisk int8_gemm: scale must be float32 [out]");
  const int64_t m_rows = x.size(0), out = q.size(0), in = q.size(1);
  auto xf = x.to(torch::kFloat32).contiguous();
  auto y = torch::empty({m_rows, out}, x.options().dtype(torch::kFloat32));
  small_gemm_rows(q.data_ptr<int8_t>(), xf.data_ptr<float>(), y.data_ptr<float>(), m_rows, out, in);
  y.mul_(scale.view({1, out}));
  if (bias.has_value()) y.add_(bias->to(torch::kFloat32));
  return y;
}

namespace {
#ifdef BRISK_X86
constexpr int64_t kTileCols = 64;  // one cache line of int8 per row per tile

// int8_gemm over the tiled layout: for weight rows [4g, 4g + 4), the 64 columns [64c, 64c + 64)
// of each row lie side by side (256 contiguous bytes), so a thread's share is one sequential
// stream instead of four row streams 'in' bytes apart. The hardware prefetchers follow one
// stream; measured on the default model's int8 weights, cold: 8.1 ms per token -> 4.9 ms.
// Sums run in the order block_avx512 uses (one accumulator per row, columns ascending in 16s),
// so results equal int8_gemm's on the row-major weight bit for bit.
template <int MB>
__attribute__((target("avx512f"))) inline void tiled_block(const int8_t* t, const float* x, float* y, int64_t out,
                                                           int64_t in, bool prefetch) {
  __m512 acc[kRows][MB];
  for (int j = 0; j < kRows; ++j)
    for (int k = 0; k < MB; ++k) acc[j][k] = _mm512_setzero_ps();
  for (int64_t c = 0; c < in; c += kTileCols) {
    const int8_t* b = t + c * kRows;
    // 1 KB ahead in the same stream (it runs on into the next group's tiles)
    if (prefetch)
      for (int j = 0; j < kRows; ++j) _mm_prefetch(reinterpret_cast<const char*>(b + 1024 + j * 64), _MM_HINT_T0);
    for (int64_t i = 0; i < kTileCols; i += 16) {
      __m512 wv[kRows];
      for (int j = 0; j < kRows; ++j) wv[j] = load16(b + j * kTileCols + i);
      for (int k = 0; k < MB; ++k) {
        const __m512 xv = _mm512_loadu_ps(x + k * in + c + i);
        for (int j = 0; j < kRows; ++j) acc[j][k] = _mm512_fmadd_ps(wv[j], xv, acc[j][k]);
      }
    }
  }
  for (int k = 0; k < MB; ++k)
    for (int j = 0; j < kRows; ++j) y[k * out + j] = _mm512_reduce_add_ps(acc[j][k]);
}

__attribute__((target("avx512f"))) void tiled_rows(const int8_t* t, const float* x, float* y, int64_t m_rows,
                                                   int64_t out, int64_t g0, int64_t g1, int64_t in) {
  for (int64_t g = g0; g < g1; ++g) {
    const int8_t* tg = t + g * kRows * in;
    float* yg = y + g * kRows;
    int64_t m = 0;  // passes of up to four x rows; later passes find the group's 4 * in bytes in L1
    for (; m + 4 <= m_rows; m += 4) tiled_block<4>(tg, x + m * in, yg + m * out, out, in, m == 0);
    switch (m_rows - m) {
      case 3: tiled_block<3>(tg, x + m * in, yg + m * out, out, in, m == 0); break;
      case 2: tiled_block<2>(tg, x + m * in, yg + m * out, out, in, m == 0); break;
      case 1: tiled_block<1>(tg, x + m * in, yg + m * out, out, in, m == 0); break;
      default: break;
    }
  }
}
#endif
}  // namespace

// int8_gemm with q in the tiled layout (quant/int8.py tile_rows): out % 4 == 0, in % 64 == 0.
torch::Tensor int8_gemm_tiled(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                              const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(brisk_isa::avx512(), "brisk int8_gemm_tiled: needs AVX-512");
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.dim() == 2 && q.is_contiguous(),
              "brisk int8_gemm_tiled: q must be a contiguous int8 [out, in]");
  const int64_t m_rows = x.size(0), out = q.size(0), in = q.size(1);
  TORCH_CHECK(out % kRows == 0 && in % 64 == 0, "brisk int8_gemm_tiled: needs out % 4 == 0 and in % 64 == 0, got ",
              out, " x ", in);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in, "brisk int8_gemm_tiled: x does not fit q");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.numel() == out, "brisk int8_gemm_tiled: scale must be float32 [out]");
  auto xf = x.to(torch::kFloat32).contiguous();
  auto y = torch::empty({m_rows, out}, x.options().dtype(torch::kFloat32));
#ifdef BRISK_X86
  const int8_t* t = q.data_ptr<int8_t>();
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out / kRows, 8, [&](int64_t g0, int64_t g1) { tiled_rows(t, xp, yp, m_rows, out, g0, g1, in); });
#endif
  y.mul_(scale.view({1, out}));
  if (bias.has_value()) y.add_(bias->to(torch::kFloat32));
  return y;
}

namespace brisk_range {

void float_rows(const float* w, const float* x, float* y, int64_t m, int64_t out, int64_t in, int64_t r0, int64_t r1) {
#ifdef BRISK_X86
  if (m == 1) return rows(w, x, y, r0, r1, in);  // gemv
  small_gemm_avx512(w, x, y, m, out, r0, r1, in);
#endif
}

void int8_rows(const int8_t* q, const float* x, float* y, int64_t m, int64_t out, int64_t in, int64_t r0, int64_t r1) {
#ifdef BRISK_X86
  small_gemm_avx512(q, x, y, m, out, r0, r1, in);
#endif
}

void int8_tiled_rows(const int8_t* q, const float* x, float* y, int64_t m, int64_t out, int64_t in, int64_t r0,
                     int64_t r1) {
#ifdef BRISK_X86
  tiled_rows(q, x, y, m, out, r0 / kRows, r1 / kRows, in);
#endif
}

}  // namespace brisk_range
