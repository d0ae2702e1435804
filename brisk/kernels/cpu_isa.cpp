#include "isa.h"

#include <torch/extension.h>

#include <atomic>
#include <chrono>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace brisk_isa {
namespace {

Level detect() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return Level::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Level::kAvx2;
#endif
  return Level::kScalar;
}

bool detect_vnni() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") != 0 && __builtin_cpu_supports("avx512bw") != 0;
#else
  return false;
#endif
}

bool detect_avx_vnni() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avxvnni") != 0 && __builtin_cpu_supports("avx2") != 0;
#else
  return false;
#endif
}

// AMX-BF16 tiles usable by this process: the CPU has them (cpuid 7: AMX-TILE, AMX-BF16), the OS
// saves their state (XCR0 bits 17, 18), and Linux grants the process the tile data (arch_prctl
// ARCH_REQ_XCOMP_PERM, as oneDNN asks too). torch's bf16 GEMMs (oneDNN) then run on the tiles.
bool detect_amx_bf16() {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__linux__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE: xgetbv allowed
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(d & (1u << 22)) || !(d & (1u << 24))) return false;  // AMX-BF16, AMX-TILE
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return false;  // XTILECFG and XTILEDATA state enabled
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
#else
  return false;
#endif
}

#if defined(__x86_64__) || defined(_M_X64)
// Seconds for kIters steps of kChains independent FMA chains on vectors of one width (enough chains
// to keep two FMA ports busy through their 4-cycle latency); the best of three runs. A macro, so
// each width's loop is compiled inside a function of its own target.
constexpr int kChains = 12;
constexpr long kIters = 1 << 14;

#define BRISK_FMA_SECONDS(V, SET, FMA)                                                   \
  double best = 1e9;                                                                     \
  for (int run = 0; run < 3; ++run) {                                                    \
    V acc[kChains];                                                                      \
    for (int c = 0; c < kChains; ++c) acc[c] = SET(1.0f + 1e-3f * c);                    \
    const V m = SET(0.9999f), a = SET(1e-4f);                                            \
    const auto t0 = std::chrono::steady_clock::now();                                    \
    for (long i = 0; i < kIters; ++i)                                                    \
      for (int c = 0; c < kChains; ++c) acc[c] = FMA(acc[c], m, a);                      \
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); \
    V sum = acc[0];                                                                      \
    for (int c = 1; c < kChains; ++c) sum = FMA(sum, m, acc[c]);                         \
    volatile float sink = reinterpret_cast<const float*>(&sum)[0]; /* keeps the chains */ \
    (void)sink;                                                                          \
    best = std::min(best, t);                                                            \
  }                                                                                      \
  return best;

__attribute__((target("avx2,fma"))) double fma256_seconds() { BRISK_FMA_SECONDS(__m256, _mm256_set1_ps, _mm256_fmadd_ps) }
__attribute__((target("avx512f"))) double fma512_seconds() { BRISK_FMA_SECONDS(__m512, _mm512_set1_ps, _mm512_fmadd_ps) }
#undef BRISK_FMA_SECONDS
#endif

// How much more float work a second 512-bit FMAs do than 256-bit ones: ~2 where they run at full
// rate (Intel's server cores with two 512-bit FMA ports), ~1 where not (AMD's Zen 4 runs each as two
// 256-bit halves; Intel parts with one 512-bit port). CPUID does not say; ~1 ms of timed FMA loops on
// one core do. 0 below the avx512 level.
double detect_fma512_ratio() {
#if defined(__x86_64__) || defined(_M_X64)
  if (detect() != Level::kAvx512) return 0.0;
  const double t256 = fma256_seconds(), t512 = fma512_seconds();
  return 2.0 * t256 / t512;
#else
  return 0.0;
#endif
}

const Level kCpu = detect();
const bool kVnni = detect_vnni();
const bool kAvxVnni = detect_avx_vnni();
const bool kAmxBf16 = detect_amx_bf16();
std::atomic<int> g_active{static_cast<int>(kCpu)};
std::atomic<bool> g_avx_vnni{kAvxVnni};

}  // namespace

Level cpu() { return kCpu; }
Level active() { return static_cast<Level>(g_active.load(std::memory_order_relaxed)); }
bool vnni() { return kVnni && avx512(); }
bool cpu_avx_vnni() { return kAvxVnni; }
bool cpu_amx_bf16() { return kAmxBf16; }
double cpu_fma512_ratio() {
  static const double ratio = detect_fma512_ratio();  // timed once, when first asked
  return ratio;
}
bool avx_vnni() { return g_avx_vnni.load(std::memory_order_relaxed) && active() == Level::kAvx2; }
void set_avx_vnni(bool on) { g_avx_vnni.store(on && kAvxVnni, std::memory_order_relaxed); }

void set(Level level) {
  g_active.store(std::min(static_cast<int>(level), static_cast<int>(kCpu)), std::memory_order_relaxed);
}

std::string name(Level level) {
  switch (level) {
    case Level::kAvx512: return "avx512";
    case Level::kAvx2: return "avx2";
    default: return "scalar";
  }
}

Level parse(const std::string& s) {
  if (s == "avx512") return Level::kAvx512;
  if (s == "avx2") return Level::kAvx2;
  if (s == "scalar") return Level::kScalar;
  TORCH_CHECK(false, "brisk: unknown instruction set '", s, "'; use avx512, avx2 or scalar");
}

}  // namespace brisk_isa
