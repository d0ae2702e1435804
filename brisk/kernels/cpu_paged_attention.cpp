// Exact attention over a paged KV cache, for the decode side of a mixed batch on CPU.
//
// Cache layout (one layer):
//
//   k_cache: [num_blocks, num_kv_heads, head_dim, block_size]   keys stored transposed, so the
//   v_cache: [num_blocks, num_kv_heads, block_size, head_dim]   scores of a whole block are
//                                                               head_dim broadcast-FMAs, with no
//   one (block, kv head) is a contiguous 4 KiB-ish tile         horizontal sums
//
//   block_tables[s, j] = physical block holding tokens j*block_size .. (j+1)*block_size-1 of seq s
//
// Each work item is one query token and one KV head; it serves all the query heads of that KV
// head's group (GQA), so every key and value row is read once per group, straight from its
// block: no gather into a contiguous copy. Softmax is computed online, block by block, in
// float32 (flash-attention style), which is exact up to floating-point summation order and a
// polynomial exp accurate to about one float ulp.
// Query i of a sequence with n new tokens and kv_len cached-plus-new tokens sits at position
// p = kv_len - n + i and sees keys 0 .. p (causal), or p - window + 1 .. p on a sliding layer:
// blocks wholly before the window are never read, the slots before it in its first block are
// masked out.
//
// The hot function is compiled for AVX-512, AVX2 and baseline x86-64 and picked by the ISA in use
// (isa.h); plain loops are left to the compiler to vectorise.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

constexpr int kMaxGroup = 16;     // query heads per KV head
constexpr int kMaxHeadDim = 256;
constexpr int kMaxBlock = 256;    // block_size

inline float load(const float* p, int i) { return p[i]; }
inline float load(const c10::BFloat16* p, int i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  float scale;
};

// exp(x) for x <= 0 to ~1 ulp (Cephes expf: range reduction by ln 2, degree-5 polynomial), written
// as straight-line float code so a loop of it vectorises. Inputs below -87.3 give ~1e-38, not 0.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.3f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// One query token x query heads g0 .. g0 + gn - 1 of one KV head's group. q/out point at the
// token's [num_heads, head_dim] row. Every head's arithmetic is the same whichever heads share the
// call, so how work is split over threads never changes a result.
// BS, HD > 0 fix the block size and head dim at compile time, so the per-block loops become whole
// vectors with accumulators held in registers; 0 reads them from the shape (any size, slower).
template <typename T, int BS, int HD>
inline __attribute__((always_inline)) void attend_token(const T* __restrict q, T* __restrict out,
                                                        const T* __restrict k_cache, const T* __restrict v_cache,
                                                        const int32_t* block_table, int64_t first, int64_t ctx_len,
                                                        int64_t kvh, int64_t g0, int64_t gn, const Shape& s) {
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t d = HD > 0 ? HD : s.head_dim;
  const int64_t bs = BS > 0 ? BS : s.block_size;
  q += g0 * d;  // heads g0.. are this call's heads 0..
  out += g0 * d;
  alignas(64) float qf[kMaxGroup][kMaxHeadDim];
  alignas(64) float acc[kMaxGroup][kMaxHeadDim];
  alignas(64) float p[kMaxGroup][kMaxBlock];
  float m[kMaxGroup], l[kMaxGroup];
  for (int64_t g = 0; g < gn; ++g) {
    const T* qh = q + (kvh * group + g) * d;
    for (int64_t i = 0; i < d; ++i) { qf[g][i] = load(qh, i) * s.scale; acc[g][i] = 0.f; }
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
  const int64_t tile = bs * d;
  for (int64_t j = first / bs; j * bs < ctx_len; ++j) {
    const int64_t n = std::min(bs, ctx_len - j * bs);
    const int64_t r0 = std::max<int64_t>(0, first - j * bs);  // slots before the window: skipped
    const int64_t base = (static_cast<int64_t>(block_table[j]) * s.num_kv_heads + kvh) * tile;
    const T* kt = k_cache + base;
    const T* vt = v_cache + base;
    for (int64_t g = 0; g < gn; ++g) {
      // scores of all block_size slots at once: p[r] = sum_i q[i] * K[i][r] (slots >= n ignored)
      float* __restrict pg = p[g];
      for (int64_t r = 0; r < bs; ++r) pg[r] = 0.f;
      for (int64_t i = 0; i < d; ++i) {
        const float qi = qf[g][i];
        const T* __restrict krow = kt + i * bs;
        for (int64_t r = 0; r < bs; ++r) pg[r] += qi * load(krow, r);
      }
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t r = r0; r < n; ++r) block_max = std::max(block_max, pg[r]);
      const float new_m = std::max(m[g], block_max);
      const float rescale = exp_nonpositive(m[g] - new_m);  // 0 on the first block (m = -inf)
      for (int64_t r = r0; r < n; ++r) p[g][r] = exp_nonpositive(p[g][r] - new_m);
      float block_sum = 0.f;
      for (int64_t r = r0; r < n; ++r) block_sum += p[g][r];
      l[g] = l[g] * rescale + block_sum;
      for (int64_t i = 0; i < d; ++i) acc[g][i] *= rescale;
      for (int64_t r = r0; r < n; ++r) {
        const float pr = p[g][r];
        const T* vr = vt + r * d;
        for (int64_t i = 0; i < d; ++i) acc[g][i] += pr * load(vr, i);
      }
      m[g] = new_m;
    }
  }
  for (int64_t g = 0; g < gn; ++g) {
    T* oh = out + (kvh * group + g) * d;
    const float inv = 1.f / l[g];
    for (int64_t i = 0; i < d; ++i) oh[i] = static_cast<T>(acc[g][i] * inv);
  }
}

#ifdef BRISK_X86
// Blocks are scattered, so the hardware prefetcher cannot guess the next ones: the vector kernels
// fetch the key and value tiles of the block two ahead into L2 while this one is computed.
template <typename T, int HD>
inline void prefetch_tiles(const T* k_cache, const T* v_cache, int32_t block, int64_t kvh, const Shape& s) {
  constexpr int64_t kTile = 16 * HD;
  const int64_t at = (static_cast<int64_t>(block) * s.num_kv_heads + kvh) * kTile;
  const char* kn = reinterpret_cast<const char*>(k_cache + at);
  const char* vn = reinterpret_cast<const char*>(v_cache + at);
  for (size_t c = 0; c < kTile * sizeof(T); c += 64) {
    _mm_prefetch(kn + c, _MM_HINT_T1);
    _mm_prefetch(vn + c, _MM_HINT_T1);
  }
}

// The common shape (block 16, head dim a multiple of 16) in AVX-512: a block's 16 scores are one
// register; keys stream in as head_dim broadcast-FMAs, values as 16 x head_dim/16 FMAs. G query
// heads go through each block together: their independent FMA chains hide each other's latency
// (one head alone waits on its chains most of the time), and K and V are read once for all G.
template <typename T, int HD, int G>
__attribute__((target("avx512f"))) void attend_heads_avx512(const T* q, T* out, const T* k_cache, const T* v_cache,
                                                           const int32_t* block_table, int64_t first, int64_t ctx_len,
                                                           int64_t kvh, int64_t g0, const Shape& s) {
  using brisk_simd::load16;
  constexpr int kBs = 16, kNv = HD / 16;
  const int64_t group = s.num_heads / s.num_kv_heads;
  alignas(64) float qf[G][HD];
  __m512 acc[G][kNv];
  float m[G], l[G];
  for (int g = 0; g < G; ++g) {
    const T* qh = q + (kvh * group + g0 + g) * HD;
    for (int v = 0; v < kNv; ++v) {
      _mm512_store_ps(qf[g] + 16 * v, _mm512_mul_ps(load16(qh + 16 * v), _mm512_set1_ps(s.scale)));
      acc[g][v] = _mm512_setzero_ps();
    }
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = first / kBs; j * kBs < ctx_len; ++j) {
    const int64_t n = std::min<int64_t>(kBs, ctx_len - j * kBs);
    const int64_t r0 = std::max<int64_t>(0, first - j * kBs);  // slots before the window: masked out
    const __mmask16 valid = static_cast<__mmask16>((n == kBs ? 0xFFFFu : (1u << n) - 1) & ~((1u << r0) - 1));
    const int64_t base = (static_cast<int64_t>(block_table[j]) * s.num_kv_heads + kvh) * kBs * HD;
    const T* kt = k_cache + base;  // [HD][16]
    const T* vt = v_cache + base;  // [16][HD]
    if ((j + 2) * kBs < ctx_len) prefetch_tiles<T, HD>(k_cache, v_cache, block_table[j + 2], kvh, s);
    __m512 s0[G], s1[G];
    for (int g = 0; g < G; ++g) s0[g] = s1[g] = _mm512_setzero_ps();
    for (int i = 0; i < HD; i += 2) {
      const __m512 k0 = load16(kt + i * kBs), k1 = load16(kt + (i + 1) * kBs);
      for (int g = 0; g < G; ++g) {
        s0[g] = _mm512_fmadd_ps(_mm512_set1_ps(qf[g][i]), k0, s0[g]);
        s1[g] = _mm512_fmadd_ps(_mm512_set1_ps(qf[g][i + 1]), k1, s1[g]);
      }
    }
    alignas(64) float pa[G][kBs];
    for (int g = 0; g < G; ++g) {
      const __m512 scores = _mm512_mask_mov_ps(neg_inf, valid, _mm512_add_ps(s0[g], s1[g]));
      const float new_m = std::max(m[g], _mm512_reduce_max_ps(scores));
      const float rescale = m[g] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m[g] - new_m);
      const __m512 p = _mm512_maskz_mov_ps(valid, brisk_simd::exp512_nonpositive(
                                                      _mm512_sub_ps(scores, _mm512_set1_ps(new_m))));
      l[g] = l[g] * rescale + _mm512_reduce_add_ps(p);
      _mm512_store_ps(pa[g], p);
      const __m512 rs = _mm512_set1_ps(rescale);
      for (int v = 0; v < kNv; ++v) acc[g][v] = _mm512_mul_ps(acc[g][v], rs);
      m[g] = new_m;
    }
    for (int64_t r = r0; r < n; ++r) {
      __m512 vr[kNv];
      for (int v = 0; v < kNv; ++v) vr[v] = load16(vt + r * HD + 16 * v);
      for (int g = 0; g < G; ++g) {
        const __m512 pr = _mm512_set1_ps(pa[g][r]);
        for (int v = 0; v < kNv; ++v) acc[g][v] = _mm512_fmadd_ps(pr, vr[v], acc[g][v]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    alignas(64) float o[HD];
    const __m512 inv = _mm512_set1_ps(1.f / l[g]);
    for (int v = 0; v < kNv; ++v) _mm512_store_ps(o + 16 * v, _mm512_mul_ps(acc[g][v], inv));
    T* oh = out + (kvh * group + g0 + g) * HD;
    for (int i = 0; i < HD; ++i) oh[i] = static_cast<T>(o[i]);
  }
}

// Heads g0 .. g0 + gn - 1 in passes of up to 4 (more would spill the accumulators at head dim 128).
template <typename T, int HD>
__attribute__((target("avx512f"))) void attend_token_avx512(const T* q, T* out, const T* k, const T* v,
                                                           const int32_t* bt, int64_t first, int64_t ctx, int64_t kvh,
                                                           int64_t g0, int64_t gn, const Shape& s) {
  // four heads' accumulators fit the 32 registers up to head dim 128; at 256 two do
  constexpr int kMax = HD > 128 ? 2 : 4;
  for (int64_t g = g0; g < g0 + gn;) {
    const int64_t left = g0 + gn - g;
    if (left >= 4 && kMax >= 4) attend_heads_avx512<T, HD, 4>(q, out, k, v, bt, first, ctx, kvh, g, s), g += 4;
    else if (left == 3 && kMax >= 3) attend_heads_avx512<T, HD, 3>(q, out, k, v, bt, first, ctx, kvh, g, s), g += 3;
    else if (left >= 2) attend_heads_avx512<T, HD, 2>(q, out, k, v, bt, first, ctx, kvh, g, s), g += 2;
    else attend_heads_avx512<T, HD, 1>(q, out, k, v, bt, first, ctx, kvh, g, s), g += 1;
  }
}
// attend_heads_avx512 on 8-lane vectors: a block's 16 scores are two registers (slots 0-7 and
// 8-15), each summed over even and odd i apart as s0 and s1 are, the probabilities through
// exp256_nonpositive and their sum in _mm512_reduce_add_ps's order (GCC's: halves, quarters, then
// pairs: brisk_simd::reduce_add16), so every float is the AVX-512 kernel's: the same attention
// output bit for bit.
using brisk_simd::reduce_add16;

__attribute__((target("avx2,fma"))) inline float reduce_max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

template <typename T, int HD, int G>
__attribute__((target("avx2,fma"))) void attend_heads_avx2(const T* q, T* out, const T* k_cache, const T* v_cache,
                                                          const int32_t* block_table, int64_t first, int64_t ctx_len,
                                                          int64_t kvh, int64_t g0, const Shape& s) {
  using brisk_simd::load8;
  constexpr int kBs = 16, kNv = HD / 8;
  const int64_t group = s.num_heads / s.num_kv_heads;
  alignas(32) float qf[G][HD];
  __m256 acc[G][kNv];
  float m[G], l[G];
  for (int g = 0; g < G; ++g) {
    const T* qh = q + (kvh * group + g0 + g) * HD;
    for (int v = 0; v < kNv; ++v) {
      _mm256_store_ps(qf[g] + 8 * v, _mm256_mul_ps(load8(qh + 8 * v), _mm256_set1_ps(s.scale)));
      acc[g][v] = _mm256_setzero_ps();
    }
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i slot_lo = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), slot_hi = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t j = first / kBs; j * kBs < ctx_len; ++j) {
    const int64_t n = std::min<int64_t>(kBs, ctx_len - j * kBs);
    const int64_t r0 = std::max<int64_t>(0, first - j * kBs);
    // slot r is valid when r0 <= r < n
    const __m256i lo_r0 = _mm256_set1_epi32(static_cast<int>(r0) - 1), hi_n = _mm256_set1_epi32(static_cast<int>(n));
    const __m256 valid_lo = _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_cmpgt_epi32(slot_lo, lo_r0), _mm256_cmpgt_epi32(hi_n, slot_lo)));
    const __m256 valid_hi = _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_cmpgt_epi32(slot_hi, lo_r0), _mm256_cmpgt_epi32(hi_n, slot_hi)));
    const int64_t base = (static_cast<int64_t>(block_table[j]) * s.num_kv_heads + kvh) * kBs * HD;
    const T* kt = k_cache + base;
    const T* vt = v_cache + base;
    if ((j + 2) * kBs < ctx_len) prefetch_tiles<T, HD>(k_cache, v_cache, block_table[j + 2], kvh, s);
    __m256 s0[G][2], s1[G][2];  // [head][slots 0-7, 8-15], even and odd i
    for (int g = 0; g < G; ++g) s0[g][0] = s0[g][1] = s1[g][0] = s1[g][1] = _mm256_setzero_ps();
    for (int i = 0; i < HD; i += 2) {
      const __m256 k0a = load8(kt + i * kBs), k0b = load8(kt + i * kBs + 8);
      const __m256 k1a = load8(kt + (i + 1) * kBs), k1b = load8(kt + (i + 1) * kBs + 8);
      for (int g = 0; g < G; ++g) {
        const __m256 q0 = _mm256_set1_ps(qf[g][i]), q1 = _mm256_set1_ps(qf[g][i + 1]);
        s0[g][0] = _mm256_fmadd_ps(q0, k0a, s0[g][0]);
        s0[g][1] = _mm256_fmadd_ps(q0, k0b, s0[g][1]);
        s1[g][0] = _mm256_fmadd_ps(q1, k1a, s1[g][0]);
        s1[g][1] = _mm256_fmadd_ps(q1, k1b, s1[g][1]);
      }
    }
    alignas(32) float pa[G][kBs];
    for (int g = 0; g < G; ++g) {
      const __m256 sc_lo = _mm256_blendv_ps(neg_inf, _mm256_add_ps(s0[g][0], s1[g][0]), valid_lo);
      const __m256 sc_hi = _mm256_blendv_ps(neg_inf, _mm256_add_ps(s0[g][1], s1[g][1]), valid_hi);
      const float new_m = std::max(m[g], reduce_max8(_mm256_max_ps(sc_lo, sc_hi)));
      const float rescale = m[g] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m[g] - new_m);
      const __m256 nm = _mm256_set1_ps(new_m);
      const __m256 p_lo = _mm256_and_ps(valid_lo, brisk_simd::exp256_nonpositive(_mm256_sub_ps(sc_lo, nm)));
      const __m256 p_hi = _mm256_and_ps(valid_hi, brisk_simd::exp256_nonpositive(_mm256_sub_ps(sc_hi, nm)));
      l[g] = l[g] * rescale + reduce_add16(p_lo, p_hi);
      _mm256_store_ps(pa[g], p_lo);
      _mm256_store_ps(pa[g] + 8, p_hi);
      const __m256 rs = _mm256_set1_ps(rescale);
      for (int v = 0; v < kNv; ++v) acc[g][v] = _mm256_mul_ps(acc[g][v], rs);
      m[g] = new_m;
    }
    for (int64_t r = r0; r < n; ++r) {
      for (int v = 0; v < kNv; ++v) {
        const __m256 vr = load8(vt + r * HD + 8 * v);
        for (int g = 0; g < G; ++g) acc[g][v] = _mm256_fmadd_ps(_mm256_set1_ps(pa[g][r]), vr, acc[g][v]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    alignas(32) float o[HD];
    const __m256 inv = _mm256_set1_ps(1.f / l[g]);
    for (int v = 0; v < kNv; ++v) _mm256_store_ps(o + 8 * v, _mm256_mul_ps(acc[g][v], inv));
    T* oh = out + (kvh * group + g0 + g) * HD;
    for (int i = 0; i < HD; ++i) oh[i] = static_cast<T>(o[i]);
  }
}

// Heads g0 .. g0 + gn - 1 in passes of two (one at head dim 128 and up: 16 registers).
template <typename T, int HD>
__attribute__((target("avx2,fma"))) void attend_token_avx2(const T* q, T* out, const T* k, const T* v,
                                                          const int32_t* bt, int64_t first, int64_t ctx, int64_t kvh,
                                                          int64_t g0, int64_t gn, const Shape& s) {
  for (int64_t g = g0; g < g0 + gn;) {
    if (HD < 128 && g0 + gn - g >= 2) attend_heads_avx2<T, HD, 2>(q, out, k, v, bt, first, ctx, kvh, g, s), g += 2;
    else attend_heads_avx2<T, HD, 1>(q, out, k, v, bt, first, ctx, kvh, g, s), g += 1;
  }
}
#endif

template <typename T>
inline __attribute__((always_inline)) void attend_token_any(const T* q, T* out, const T* k, const T* v,
                                                            const int32_t* bt, int64_t first, int64_t ctx, int64_t kvh,
                                                            int64_t g0, int64_t gn, const Shape& s) {
#ifdef BRISK_X86
  if (s.block_size == 16 && brisk_isa::avx512()) {
    if (s.head_dim == 64) return attend_token_avx512<T, 64>(q, out, k, v, bt, first, ctx, kvh, g0, gn, s);
    if (s.head_dim == 128) return attend_token_avx512<T, 128>(q, out, k, v, bt, first, ctx, kvh, g0, gn, s);
    if (s.head_dim == 256) return attend_token_avx512<T, 256>(q, out, k, v, bt, first, ctx, kvh, g0, gn, s);
  }
  if (s.block_size == 16 && brisk_isa::active() == brisk_isa::Level::kAvx2) {
    if (s.head_dim == 64) return attend_token_avx2<T, 64>(q, out, k, v, bt, first, ctx, kvh, g0, gn, s);
    if (s.head_dim == 128) return attend_token_avx2<T, 128>(q, out, k, v, bt, first, ctx, kvh, g0, gn, s);
    if (s.head_dim == 256) return attend_token_avx2<T, 256>(q, out, k, v, bt, first, ctx, kvh, g0, gn, s);
  }
#endif
  if (s.block_size == 16 && s.head_dim == 64)
    return attend_token<T, 16, 64>(q, out, k, v, bt, first, ctx, kvh, g0, gn, s);
  if (s.block_size == 16 && s.head_dim == 128)
    return attend_token<T, 16, 128>(q, out, k, v, bt, first, ctx, kvh, g0, gn, s);
  if (s.block_size == 16 && s.head_dim == 256)
    return attend_token<T, 16, 256>(q, out, k, v, bt, first, ctx, kvh, g0, gn, s);
  return attend_token<T, 0, 0>(q, out, k, v, bt, first, ctx, kvh, g0, gn, s);
}

// attend_token_any compiled whole (flatten: every call inside inlined) for each instruction set, and
// picked by the one the kernels use (BRISK_CPU_ISA can lower it, so each copy runs in the tests;
// target_clones would pick by the CPU alone).
#define BRISK_ATTEND(NAME, T, ATTR)                                                                          \
  ATTR __attribute__((flatten)) void NAME(const T* q, T* out, const T* k, const T* v, const int32_t* bt,    \
                                          int64_t first, int64_t ctx, int64_t kvh, int64_t g0, int64_t gn,  \
                                          const Shape& s) {                                                 \
    attend_token_any(q, out, k, v, bt, first, ctx, kvh, g0, gn, s);                                         \
  }
BRISK_ATTEND(attend_base_f32, float, )
BRISK_ATTEND(attend_base_bf16, c10::BFloat16, )
#ifdef BRISK_X86
BRISK_ATTEND(attend_avx2_f32, float, __attribute__((target("avx2,fma"))))
BRISK_ATTEND(attend_avx2_bf16, c10::BFloat16, __attribute__((target("avx2,fma"))))
BRISK_ATTEND(attend_avx512_f32, float, __attribute__((target("avx512f"))))
BRISK_ATTEND(attend_avx512_bf16, c10::BFloat16, __attribute__((target("avx512f"))))
#endif
#undef BRISK_ATTEND

void attend_token_f32(const float* q, float* out, const float* k, const float* v, const int32_t* bt, int64_t first,
                      int64_t ctx, int64_t kvh, int64_t g0, int64_t gn, const Shape& s) {
#ifdef BRISK_X86
  if (brisk_isa::avx512()) return attend_avx512_f32(q, out, k, v, bt, first, ctx, kvh, g0, gn, s);
  if (brisk_isa::at_least_avx2()) return attend_avx2_f32(q, out, k, v, bt, first, ctx, kvh, g0, gn, s);
#endif
  attend_base_f32(q, out, k, v, bt, first, ctx, kvh, g0, gn, s);
}

void attend_token_bf16(const c10::BFloat16* q, c10::BFloat16* out, const c10::BFloat16* k, const c10::BFloat16* v,
                       const int32_t* bt, int64_t first, int64_t ctx, int64_t kvh, int64_t g0, int64_t gn,
                       const Shape& s) {
#ifdef BRISK_X86
  if (brisk_isa::avx512()) return attend_avx512_bf16(q, out, k, v, bt, first, ctx, kvh, g0, gn, s);
  if (brisk_isa::at_least_avx2()) return attend_avx2_bf16(q, out, k, v, bt, first, ctx, kvh, g0, gn, s);
#endif
  attend_base_bf16(q, out, k, v, bt, first, ctx, kvh, g0, gn, s);
}

}  // namespace

namespace brisk_range {

AttentionStep attention_step(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             const torch::Tensor& block_tables, const torch::Tensor& query_start,
                             const torch::Tensor& kv_lens, double scale, int64_t num_tokens, int64_t threads,
                             int64_t window) {
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && query_start.scalar_type() == torch::kInt32 &&
                  kv_lens.scalar_type() == torch::kInt32 && block_tables.is_contiguous() &&
                  query_start.is_contiguous() && kv_lens.is_contiguous(),
              "paged_attention: index tensors must be contiguous int32");
  TORCH_CHECK(num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= kMaxGroup && head_dim <= kMaxHeadDim &&
                  block_size <= kMaxBlock, "paged_attention: unsupported shape");
  AttentionStep a;
  a.num_heads = num_heads, a.num_kv_heads = num_kv_heads, a.head_dim = head_dim, a.block_size = block_size;
  a.max_blocks = block_tables.size(1), a.scale = static_cast<float>(scale), a.num_tokens = num_tokens;
  a.block_tables = block_tables.data_ptr<int32_t>();
  const int64_t num_seqs = kv_lens.size(0);
  TORCH_CHECK(query_start.numel() == num_seqs + 1, "paged_attention: query_start needs one entry per sequence + 1");
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* lens = kv_lens.data_ptr<int32_t>();
  TORCH_CHECK(qs[0] == 0 && qs[num_seqs] == num_tokens, "paged_attention: query_start does not span the ", num_tokens,
              " tokens");
  // token -> (sequence, its causal context length), so work items are flat and independent
  TORCH_CHECK(window >= 0, "paged_attention: window must be >= 0 (0: no sliding window)");
  a.seq_of.resize(num_tokens), a.ctx_of.resize(num_tokens), a.first_of.resize(num_tokens);
  for (int64_t sq = 0; sq < num_seqs; ++sq) {
    const int64_t n = qs[sq + 1] - qs[sq];
    TORCH_CHECK(n >= 0 && lens[sq] >= n && (lens[sq] + block_size - 1) / block_size <= a.max_blocks,
                "paged_attention: kv length does not fit the block table");
    for (int64_t i = 0; i < n; ++i) {
      a.seq_of[qs[sq] + i] = sq;
      const int64_t ctx = lens[sq] - n + i + 1;
      a.ctx_of[qs[sq] + i] = ctx;
      a.first_of[qs[sq] + i] = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
    }
  }
  // Work items: (token, KV head), all its query heads at once (K and V read once). With fewer
  // items than twice the threads (a decode step of one or two sequences), each item is two, the
  // halves of its query heads, so the threads share the work more evenly (3 KV heads on 2
  // threads would leave one idle a third of the time); every head's result is the same either way.
  const int64_t group = num_heads / num_kv_heads;
  a.split = group > 1 && num_tokens * num_kv_heads < 2 * threads ? 2 : 1;
  a.items = num_tokens * num_kv_heads * a.split;
  return a;
}

template <typename T>
void attention_items_t(const AttentionStep& a, const T* q, T* out, const T* k_cache, const T* v_cache, int64_t w0,
                       int64_t w1) {
  const Shape s{a.num_heads, a.num_kv_heads, a.head_dim, a.block_size, a.max_blocks, a.scale};
  const int64_t row = s.num_heads * s.head_dim, group = s.num_heads / s.num_kv_heads, first_half = (group + 1) / 2;
  for (int64_t w = w0; w < w1; ++w) {
    const int64_t item = w / a.split, t = item / s.num_kv_heads, kvh = item % s.num_kv_heads;
    const int64_t g0 = a.split == 1 || w % 2 == 0 ? 0 : first_half;
    const int64_t gn = a.split == 1 ? group : (w % 2 == 0 ? first_half : group - first_half);
    const int32_t* table = a.block_tables + a.seq_of[t] * s.max_blocks;
    if constexpr (std::is_same_v<T, float>) {
      attend_token_f32(q + t * row, out + t * row, k_cache, v_cache, table, a.first_of[t], a.ctx_of[t], kvh, g0, gn, s);
    } else {
      attend_token_bf16(q + t * row, out + t * row, k_cache, v_cache, table, a.first_of[t], a.ctx_of[t], kvh, g0, gn,
                        s);
    }
  }
}

void attention_items(const AttentionStep& a, const float* q, float* out, const float* k_cache, const float* v_cache,
                     int64_t w0, int64_t w1) {
  attention_items_t(a, q, out, k_cache, v_cache, w0, w1);
}

}  // namespace brisk_range

// out[T, H, D] = attention of q[T, H, D] over the paged cache; sequences are the spans
// query_start[s] .. query_start[s+1] of the flat token batch, each with kv_lens[s] keys.
void paged_attention(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                     const torch::Tensor& query_start, const torch::Tensor& kv_lens, double scale, int64_t window) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: tensors must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  q.scalar_type() == out.scalar_type() &&
                  (q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16),
              "paged_attention: q, out and the caches must all be float32 or all bfloat16");
  TORCH_CHECK(k_cache.size(2) == v_cache.size(3) && k_cache.size(3) == v_cache.size(2),
              "paged_attention: k_cache must be [blocks, kv_heads, head_dim, block_size]");
  const brisk_range::AttentionStep a =
      brisk_range::attention_step(q.size(1), v_cache.size(1), v_cache.size(3), v_cache.size(2), block_tables,
                                  query_start, kv_lens, scale, q.size(0), at::get_num_threads(), window);
  TORCH_CHECK(q.size(2) == a.head_dim, "paged_attention: q's head dim differs from the cache's");
  at::parallel_for(0, a.items, 1, [&](int64_t begin, int64_t end) {
    if (q.scalar_type() == torch::kFloat32) {
      brisk_range::attention_items_t(a, q.data_ptr<float>(), out.data_ptr<float>(), k_cache.data_ptr<float>(),
                                     v_cache.data_ptr<float>(), begin, end);
    } else {
      brisk_range::attention_items_t(a, q.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(),
                                     k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(), begin, end);
    }
  });
}
