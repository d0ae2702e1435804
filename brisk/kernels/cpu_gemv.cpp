// Matrix-vector products for single-token decode on CPU, streaming the weights at memory speed.
//
// Decoding one token reads every weight once, so decode speed is memory bandwidth. For a single
// row, torch's BLAS path (MKL sgemv on an [out, in] row-major weight) reaches about half of what
// these cores can stream. These kernels walk four output rows at a time, each 16 (AVX-512) or 8
// (AVX2, portable) lanes wide, sharing every load of x across the four rows and across up to four
// rows of x (small decode batches read the weights once), and split the rows over torch's own
// thread pool. One body (cpu_gemv_simd.inc) is compiled per vector width and picked by the ISA in
// use (isa.h), so one build serves any CPU. Results equal a float32-accumulated dot product up to
// summation order, and a row's result never depends on the batch it came in.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>

#include "isa.h"
#include "kernels.h"
#include "simd.h"

namespace {

constexpr int64_t kRows = 4;       // output rows per inner loop: x is loaded once for all four
constexpr int kTileRows = 4;       // int8 tiled layout: 4 rows x
constexpr int64_t kTileCols = 64;  // 64 columns (one cache line of int8 per row) per tile

// ---- one body (cpu_gemv_simd.inc) per vector width ---------------------------------------------
#ifdef BRISK_X86
#pragma GCC push_options
#pragma GCC target("avx512f")
namespace v512 {
using Vec = __m512;
constexpr int kLanes = 16, kMaxMB = 4;  // 16 accumulators + 4 weights + x in 32 registers
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const c10::BFloat16* p) { return brisk_simd::load16(p); }
inline Vec vload(const int8_t* p) { return brisk_simd::load16(p); }
#include "cpu_gemv_simd.inc"
}  // namespace v512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace v256 {
using Vec = __m256;
constexpr int kLanes = 8, kMaxMB = 2;  // 8 accumulators + 4 weights + x in 16 registers
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const c10::BFloat16* p) { return brisk_simd::load8(p); }
inline Vec vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#include "cpu_gemv_simd.inc"
}  // namespace v256
#pragma GCC pop_options
#endif

// The portable path: 8 lanes in an array, summed in v256's order (no fma where the target has
// none, so within float rounding of it; the compiler vectorizes the lane loops).
namespace portable {
struct Vec {
  float v[8];
};
constexpr int kLanes = 8, kMaxMB = 2;
inline Vec vzero() { return Vec{}; }
inline Vec vfma(const Vec& a, const Vec& b, Vec c) {
  for (int l = 0; l < 8; ++l) c.v[l] += a.v[l] * b.v[l];
  return c;
}
inline float vsum(const Vec& a) {
  const float* v = a.v;
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}
template <typename T>
inline Vec vload(const T* p) {
  Vec r;
  for (int l = 0; l < 8; ++l) r.v[l] = static_cast<float>(p[l]);
  return r;
}
#include "cpu_gemv_simd.inc"
}  // namespace portable

// y[m, out] rows [r0, r1) = x[m, in] @ w^T at the ISA in use.
template <typename T>
void rows_any(const T* w, const float* x, float* y, int64_t m, int64_t out, int64_t r0, int64_t r1, int64_t in) {
#ifdef BRISK_X86
  const brisk_isa::Level isa = brisk_isa::active();
  if (isa == brisk_isa::Level::kAvx512) return v512::small_gemm(w, x, y, m, out, r0, r1, in);
  if (isa == brisk_isa::Level::kAvx2) return v256::small_gemm(w, x, y, m, out, r0, r1, in);
#endif
  portable::small_gemm(w, x, y, m, out, r0, r1, in);
}

void tiled_any(const int8_t* t, const float* x, float* y, int64_t m, int64_t out, int64_t g0, int64_t g1, int64_t in) {
#ifdef BRISK_X86
  const brisk_isa::Level isa = brisk_isa::active();
  if (isa == brisk_isa::Level::kAvx512) return v512::tiled_rows(t, x, y, m, out, g0, g1, in);
  if (isa == brisk_isa::Level::kAvx2) return v256::tiled_rows(t, x, y, m, out, g0, g1, in);
#endif
  portable::tiled_rows(t, x, y, m, out, g0, g1, in);
}

// The row loop of every entry point below: output rows split over threads in whole blocks of four,
// so every row is summed as it would be alone.
template <typename T>
void small_gemm_rows(const T* wp, const float* xp, float* yp, int64_t m_rows, int64_t out, int64_t in) {
  const int64_t groups = (out + kRows - 1) / kRows;
  at::parallel_for(0, groups, m_rows == 1 ? 16 : 8, [&](int64_t g0, int64_t g1) {
    rows_any<T>(wp, xp, yp, m_rows, out, g0 * kRows, std::min(out, g1 * kRows), in);
  });
}

}  // namespace

// y[1, out] = x[1, in] @ w[out, in]^T (+ bias), float32 or bfloat16, accumulated in float32: the
// one-row case of small_gemm (bfloat16 x widens to float exactly, so the floats are the same).
torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "brisk gemv: CPU tensors only");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "brisk gemv: weight must be a contiguous [out, in] matrix");
  TORCH_CHECK(x.numel() == w.size(1), "brisk gemv: x has ", x.numel(), " elements, weight expects ", w.size(1));
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "brisk gemv: x and weight dtypes differ");
  return small_gemm(x.reshape({1, w.size(1)}), w, bias);
}

// y[M, out] = x[M, in] @ w[out, in]^T (+ bias) for small M (decode batches): weights streamed once,
// every row's result the one it gets alone.
torch::Tensor small_gemm(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "brisk small_gemm: CPU tensors only");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && x.dim() == 2 && x.size(1) == w.size(1),
              "brisk small_gemm: shapes do not fit");
  const int64_t m_rows = x.size(0), out = w.size(0), in = w.size(1);
  auto xf = x.to(torch::kFloat32).contiguous();  // rows of x are reused from cache; float once
  auto y = torch::empty({m_rows, out}, x.options().dtype(torch::kFloat32));
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (w.scalar_type() == torch::kFloat32) {
    small_gemm_rows(w.data_ptr<float>(), xp, yp, m_rows, out, in);
  } else if (w.scalar_type() == torch::kBFloat16) {
    small_gemm_rows(w.data_ptr<c10::BFloat16>(), xp, yp, m_rows, out, in);
  } else {
    TORCH_CHECK(false, "brisk small_gemm: float32 or bfloat16 only, got ", w.scalar_type());
  }
  if (bias.has_value()) y.add_(bias->to(torch::kFloat32));
  return w.scalar_type() == torch::kFloat32 ? y : y.to(w.scalar_type());
}

std::string isa_name() { return brisk_isa::name(brisk_isa::active()); }

namespace {
void check_int8(const char* name, const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.dim() == 2 && q.is_contiguous() && q.device().is_cpu(),
              "brisk ", name, ": q must be a contiguous int8 CPU [out, in]");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == q.size(1), "brisk ", name, ": x does not fit q");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.numel() == q.size(0), "brisk ", name,
              ": scale must be float32 [out]");
}

// y *= scale per output row (+ bias): the int8 modules' epilogue, one rounding each as torch's ops
torch::Tensor scale_rows_(torch::Tensor y, const torch::Tensor& scale, const c10::optional<torch::Tensor>& bias) {
  y.mul_(scale.view({1, y.size(1)}));
  if (bias.has_value()) y.add_(bias->to(torch::kFloat32));
  return y;
}
}  // namespace

// y[M, out] = (x[M, in] @ q[out, in]^T) * scale[out] (+ bias): int8 weights with one float32 scale
// per output row (quant/int8.py), read at a quarter of float32's bytes and widened in registers.
// Any M; decode batches are what it is for (prefill dequantizes and uses a GEMM instead).
torch::Tensor int8_gemm(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                        const c10::optional<torch::Tensor>& bias) {
  check_int8("int8_gemm", x, q, scale);
  auto xf = x.to(torch::kFloat32).contiguous();
  auto y = torch::empty({x.size(0), q.size(0)}, x.options().dtype(torch::kFloat32));
  small_gemm_rows(q.data_ptr<int8_t>(), xf.data_ptr<float>(), y.data_ptr<float>(), x.size(0), q.size(0), q.size(1));
  return scale_rows_(y, scale, bias);
}

// int8_gemm with q in the tiled layout (quant/int8.py tile_rows): out % 4 == 0, in % 64 == 0; the
// same numbers as int8_gemm on the row-major weight, bit for bit.
torch::Tensor int8_gemm_tiled(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                              const c10::optional<torch::Tensor>& bias) {
  check_int8("int8_gemm_tiled", x, q, scale);
  const int64_t m_rows = x.size(0), out = q.size(0), in = q.size(1);
  TORCH_CHECK(out % kRows == 0 && in % kTileCols == 0, "brisk int8_gemm_tiled: needs out % 4 == 0 and in % 64 == 0, got ",
              out, " x ", in);
  auto xf = x.to(torch::kFloat32).contiguous();
  auto y = torch::empty({m_rows, out}, x.options().dtype(torch::kFloat32));
  const int8_t* t = q.data_ptr<int8_t>();
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out / kRows, 8, [&](int64_t g0, int64_t g1) { tiled_any(t, xp, yp, m_rows, out, g0, g1, in); });
  return scale_rows_(y, scale, bias);
}

namespace brisk_range {

void float_rows(const float* w, const float* x, float* y, int64_t m, int64_t out, int64_t in, int64_t r0, int64_t r1) {
  rows_any(w, x, y, m, out, r0, r1, in);
}

void int8_rows(const int8_t* q, const float* x, float* y, int64_t m, int64_t out, int64_t in, int64_t r0, int64_t r1) {
  rows_any(q, x, y, m, out, r0, r1, in);
}

void int8_tiled_rows(const int8_t* q, const float* x, float* y, int64_t m, int64_t out, int64_t in, int64_t r0,
                     int64_t r1) {
  tiled_any(q, x, y, m, out, r0 / kRows, r1 / kRows, in);
}

}  // namespace brisk_range
