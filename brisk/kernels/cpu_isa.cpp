#include "isa.h"

#include <torch/extension.h>

#include <atomic>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
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

// "intel", "amd" or "other": brisk picks the K-quant prompt path by it (kernels.float_prompt_tiles).
std::string detect_vendor() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (__builtin_cpu_is("intel")) return "intel";
  if (__builtin_cpu_is("amd")) return "amd";
#endif
  return "other";
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
std::string cpu_vendor() {
  static const std::string vendor = detect_vendor();
  return vendor;
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
