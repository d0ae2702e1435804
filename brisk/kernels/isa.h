// The instruction set brisk's kernels run: detected once from the CPU, and lowered (never raised)
// by brisk.kernels at import when BRISK_CPU_ISA asks for less, so every path can run and be tested
// on one machine. Every kernel asks here instead of querying the CPU itself.
#pragma once

#include <string>

namespace brisk_isa {

enum class Level : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

Level cpu();      // the best this CPU offers: avx512 (avx512f), avx2 (avx2 + fma) or scalar
Level active();   // what the kernels use now: cpu() unless set() lowered it
void set(Level level);  // clamps to cpu(); call before any kernel runs (brisk.kernels does, once)
bool vnni();      // AVX512-VNNI and AVX512-BW present, and avx512 active
bool cpu_avx_vnni();  // AVX-VNNI (vpdpbusd on 256-bit vectors, without AVX-512) present
bool avx_vnni();      // cpu_avx_vnni(), avx2 active, and not turned off by set_avx_vnni(false)
void set_avx_vnni(bool on);  // off: the avx2 level's maddubs + madd (same integers); call before any kernel
bool cpu_amx_bf16();  // AMX-BF16 tiles present, enabled by the OS and granted to this process
std::string cpu_vendor();  // "intel", "amd" or "other"

inline bool avx512() { return active() == Level::kAvx512; }
inline bool at_least_avx2() { return active() >= Level::kAvx2; }

std::string name(Level level);
Level parse(const std::string& name);  // "avx512" | "avx2" | "scalar"; anything else throws

}  // namespace brisk_isa
