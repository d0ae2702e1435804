// Force-included into every kernel source by .ci/emulate_isa.sh (never by a real build): the
// AVX-512 and AVX-VNNI paths run on an AVX2-only CPU through SIMDe (Debian's libsimde-dev), with
// __builtin_cpu_supports answering from BRISK_EMU_FLAGS. The kernels' logic and memory accesses
// run as written (their timing and instruction encodings do not), so the paths a team member on an
// AVX2 machine changes can still be tested, under ASan and UBSan if asked.
#pragma once
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#define _mm256_dpbusd_avx_epi32(a, b, c) simde_mm256_dpbusd_epi32(a, b, c)
#define _mm256_dpwssd_avx_epi32(a, b, c) simde_mm256_dpwssd_epi32(a, b, c)
// Debian's SIMDe aliases _mm512_madd_epi16 with the masked form's four arguments
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)
static inline int brisk_emu_supports(const char* f) {
  const char* e = std::getenv("BRISK_EMU_FLAGS");  // e.g. "avx512f,avx512bw,avx512vnni,avxvnni"
  if (!std::strcmp(f, "avx2") || !std::strcmp(f, "fma") || !std::strcmp(f, "f16c")) return 1;
  if (!e) return 0;
  const size_t n = std::strlen(f);  // a whole name of the comma-separated list ("avx512f" is not "avx512fp16")
  for (const char* at = std::strstr(e, f); at; at = std::strstr(at + 1, f))
    if ((at == e || at[-1] == ',') && (at[n] == ',' || at[n] == '\0')) return 1;
  return 0;
}
#define __builtin_cpu_supports(f) brisk_emu_supports(f)
static inline simde__m512 brisk_emu_cvtph_ps(__m256i h) {
  simde__m512_private r;
  __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h)), hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  std::memcpy(&r, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
  return simde__m512_from_private(r);
}
#define _mm512_cvtph_ps(h) brisk_emu_cvtph_ps(h)
// what SIMDe 0.7.4 lacks, lane by lane (the instruction's definition)
static inline simde__m128i brisk_emu_cvtepi32_epi8(simde__m512i a) {
  simde__m512i_private p = simde__m512i_to_private(a);
  int8_t o[16];
  for (int i = 0; i < 16; ++i) o[i] = static_cast<int8_t>(p.i32[i]);
  __m128i r; std::memcpy(&r, o, 16); return r;
}
static inline simde__m512 brisk_emu_cvtepi32_ps(simde__m512i a) {
  simde__m512i_private p = simde__m512i_to_private(a); simde__m512_private r;
  for (int i = 0; i < 16; ++i) r.f32[i] = static_cast<float>(p.i32[i]);
  return simde__m512_from_private(r);
}
// 16 lanes of type S (its bytes in `a`) widened to int32, sign or zero as S is
template <typename S, typename V>
static inline simde__m512i brisk_emu_widen(V a) {
  S s[16]; std::memcpy(s, &a, sizeof s); simde__m512i_private r;
  for (int i = 0; i < 16; ++i) r.i32[i] = s[i];
  return simde__m512i_from_private(r);
}
static inline simde__m512i brisk_emu_cvtps_epi32(simde__m512 a) {
  simde__m512_private p = simde__m512_to_private(a); simde__m512i_private r;
  for (int i = 0; i < 16; ++i) {
    const float v = std::nearbyint(p.f32[i]);
    r.i32[i] = (v >= 2147483648.0f || v < -2147483648.0f || v != v) ? INT32_MIN : static_cast<int32_t>(v);
  }
  return simde__m512i_from_private(r);
}
static inline simde__m512 brisk_emu_mask3_fmadd_ps(simde__m512 a, simde__m512 b, simde__m512 c, uint16_t k) {
  simde__m512_private pa = simde__m512_to_private(a), pb = simde__m512_to_private(b), pc = simde__m512_to_private(c);
  for (int i = 0; i < 16; ++i) if ((k >> i) & 1) pc.f32[i] = std::fma(pa.f32[i], pb.f32[i], pc.f32[i]);
  return simde__m512_from_private(pc);
}
static inline int32_t brisk_emu_reduce_add_epi32(simde__m512i a) {
  simde__m512i_private p = simde__m512i_to_private(a); uint32_t s = 0;
  for (int i = 0; i < 16; ++i) s += static_cast<uint32_t>(p.i32[i]);
  return static_cast<int32_t>(s);
}
template <typename Op>
static inline float brisk_emu_reduce_ps(simde__m512 a, Op op) {  // GCC's __MM512_REDUCE_OP tree
  simde__m512_private p = simde__m512_to_private(a); float t3[8], t6[4];
  for (int i = 0; i < 8; ++i) t3[i] = op(p.f32[i + 8], p.f32[i]);
  for (int j = 0; j < 4; ++j) t6[j] = op(t3[j + 4], t3[j]);
  return op(op(t6[0], t6[2]), op(t6[1], t6[3]));
}
static inline float brisk_emu_reduce_add_ps(simde__m512 a) { return brisk_emu_reduce_ps(a, [](float x, float y) { return x + y; }); }
static inline float brisk_emu_reduce_max_ps(simde__m512 a) { return brisk_emu_reduce_ps(a, [](float x, float y) { return x > y ? x : y; }); }
static inline simde__m512i brisk_emu_shuffle_i64x2(simde__m512i a, simde__m512i b, int imm) {
  simde__m512i_private pa = simde__m512i_to_private(a), pb = simde__m512i_to_private(b), r;
  for (int l = 0; l < 4; ++l) {
    const int sel = (imm >> (2 * l)) & 3;
    std::memcpy(&r.i64[2 * l], l < 2 ? &pa.i64[2 * sel] : &pb.i64[2 * sel], 16);
  }
  return simde__m512i_from_private(r);
}
#define _mm512_cvtepi32_epi8(a) brisk_emu_cvtepi32_epi8(a)
#define _mm512_cvtepi32_ps(a) brisk_emu_cvtepi32_ps(a)
#define _mm512_cvtepi8_epi32(a) brisk_emu_widen<int8_t>(a)
#define _mm512_cvtepu8_epi32(a) brisk_emu_widen<uint8_t>(a)
#define _mm512_cvtepu16_epi32(a) brisk_emu_widen<uint16_t>(a)
#define _mm512_cvtps_epi32(a) brisk_emu_cvtps_epi32(a)
#define _mm512_mask3_fmadd_ps(a, b, c, k) brisk_emu_mask3_fmadd_ps(a, b, c, k)
#define _mm512_reduce_add_epi32(a) brisk_emu_reduce_add_epi32(a)
#define _mm512_reduce_add_ps(a) brisk_emu_reduce_add_ps(a)
#define _mm512_reduce_max_ps(a) brisk_emu_reduce_max_ps(a)
#define _mm512_shuffle_i64x2(a, b, imm) brisk_emu_shuffle_i64x2(a, b, imm)
