// The group-quantized weight layout both group kernels read (cpu_quant.cpp: float activations,
// cpu_quant_vnni.cpp: int8 activations), and the checks that a set of tensors has it. The layout
// itself is described at the top of cpu_quant.cpp and in quant/grouped.py.
#pragma once

#include <torch/extension.h>

#include <cstring>

#include "simd.h"

namespace brisk_group {

struct GroupWeights {
  const uint8_t* q;
  const uint16_t* scale;  // float16 bits [out, groups] (tiled: 4 rows x 1 group)
  const uint16_t* zero;   // float16 bits, as scale; null for 8-bit
  int64_t out, in, group, groups;
  int64_t run_bytes;  // bytes of one row's 32-column run: 16 (4-bit) or 32 (8-bit)
  bool tiled;

  // Index of row r's group g in scale and zero.
  int64_t at(int64_t r, int64_t g) const { return tiled ? ((r >> 2) * groups + g) * 4 + (r & 3) : r * groups + g; }

  // Where row r's run of columns [32 c, 32 c + 32) starts.
  const uint8_t* run(int64_t r, int64_t c) const {
    if (tiled) return q + (((r >> 2) * (in / 32) + c) * 4 + (r & 3)) * run_bytes;
    return q + (r * (in / 32) + c) * run_bytes;
  }
};

inline GroupWeights check_group_weights(const torch::Tensor& q, const torch::Tensor& scale,
                                        const c10::optional<torch::Tensor>& zero, int64_t group, int64_t bits,
                                        bool tiled) {
#ifdef BRISK_X86
  TORCH_CHECK(brisk_simd::cpu_has_avx512f(), "brisk group kernels: need AVX-512");
#else
  TORCH_CHECK(false, "brisk group kernels: need an x86-64 CPU with AVX-512");
#endif
  TORCH_CHECK(bits == 4 || bits == 8, "brisk group kernels: bits must be 4 or 8");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.device().is_cpu() && scale.device().is_cpu(),
              "brisk group kernels: q and scale must be contiguous CPU tensors");
  TORCH_CHECK(bits == 4 ? q.scalar_type() == torch::kUInt8 : q.scalar_type() == torch::kInt8,
              "brisk group kernels: 4-bit q is uint8, 8-bit q is int8");
  const int64_t out = q.size(0), in = bits == 4 ? q.size(1) * 2 : q.size(1);
  TORCH_CHECK(group > 0 && group % 32 == 0 && in % group == 0, "brisk group kernels: group ", group,
              " must be a multiple of 32 dividing ", in);
  const int64_t groups = in / group;
  TORCH_CHECK(!tiled || out % 4 == 0, "brisk group kernels: a tiled weight needs out % 4 == 0, got ", out);
  TORCH_CHECK(scale.scalar_type() == torch::kFloat16 && scale.is_contiguous() && scale.numel() == out * groups,
              "brisk group kernels: scale must be contiguous float16 [out, in / group]");
  TORCH_CHECK(bits == 8 || (zero.has_value() && zero->scalar_type() == torch::kFloat16 && zero->is_contiguous() &&
                            zero->numel() == out * groups),
              "brisk group kernels: 4-bit needs a contiguous float16 zero [out, in / group]");
  return GroupWeights{static_cast<const uint8_t*>(q.data_ptr()), static_cast<const uint16_t*>(scale.data_ptr()),
                      bits == 4 ? static_cast<const uint16_t*>(zero->data_ptr()) : nullptr, out, in, group, groups,
                      bits == 4 ? 16 : 32, tiled};
}

#ifdef BRISK_X86
// Helpers of the kernels that hold 4 weight rows in one vector (4-bit: one row a 128-bit quarter).

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
__attribute__((target("avx512f,f16c"))) inline void group_params(const GroupWeights& w, int64_t r, int64_t g,
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

#endif

}  // namespace brisk_group
