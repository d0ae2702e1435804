"""What the compiled kernels can do here, decided once at import: the one object every caller asks.

    CPU (cpuid) ──► best ISA it offers ──┐
    BRISK_CPU_ISA (optional) ────────────┴─► ISA in use (never above the CPU's) ──► brisk._C.set_isa

`BRISK_CPU_ISA=avx512|avx2|scalar` lowers the instruction set every C++ kernel dispatches to, so
the AVX2 and portable paths run (and are tested) on an AVX-512 machine; a kernel without a path at
that level is reported unavailable and its caller uses torch, as on such a CPU. A value the CPU
cannot honour, or an unknown one, is an error at start-up.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from types import ModuleType

import torch

from brisk.errors import UserError

ISA_ENV = "BRISK_CPU_ISA"
# 0: the avx2 level's block, group and W8A8 kernels use maddubs + madd even where AVX-VNNI is
AVX_VNNI_ENV = "BRISK_AVX_VNNI"
AMX_ENV = "BRISK_AMX"  # 0: prompt work on GGUF blocks stays on the integer kernels even where AMX-BF16 is
# 1 / 0: K-quant prompt work in float32 tiles or block_kgemm (the MLP's down projections: float either way)
FLOAT_TILES_ENV = "BRISK_FLOAT_PROMPT_TILES"
LEVELS = ("scalar", "avx2", "avx512")  # ascending
BUILD_HINT = "pip install torch==2.13.0 ninja && pip install --no-build-isolation -e .  (with a C++ compiler)"


@dataclass(frozen=True)
class KernelCaps:
    built: bool  # brisk._C imported
    load_error: str | None  # why it did not
    cpu_isa: str  # the best the CPU offers (one of LEVELS)
    isa: str  # what the kernels use (<= cpu_isa)
    vnni: bool  # AVX512-VNNI integer kernels usable (needs isa avx512)
    names: frozenset[str]  # the kernels this build has
    avx_vnni: bool = False  # the avx2 level's block, group and W8A8 kernels use AVX-VNNI (256-bit vpdpbusd)
    amx: bool = False  # AMX-BF16 tiles usable (CPU, OS, permission), isa avx512, not turned off by BRISK_AMX
    cpu_amx: bool = False  # AMX-BF16 usable at all: oneDNN's bf16 GEMMs run on it whatever brisk's level
    vendor: str = "other"  # the CPU's maker: intel, amd or other
    float_tiles: bool = False  # K-quant prompt work in float32 tiles, not block_kgemm (requested_float_tiles)

    @property
    def avx512(self) -> bool:
        """The AVX-512 kernels are built and in use (most kernels have no other path yet)."""
        return self.built and self.isa == "avx512"

    def has(self, name: str) -> bool:
        """The build has kernel `name` (an older in-tree build may lack newer ones)."""
        return name in self.names

    def describe(self) -> str:
        if not self.built:
            return f"C++ kernels not built ({self.load_error}); CPU {self.cpu_isa}"
        lowered = f" (lowered by {ISA_ENV})" if self.isa != self.cpu_isa else ""
        return (f"C++ kernels built; ISA {self.isa}{lowered}, CPU {self.cpu_isa}, VNNI {'yes' if self.vnni else 'no'}"
                + (", AVX-VNNI" if self.avx_vnni else "") + (", AMX-BF16" if self.amx else "")
                + f"; {self.vendor} CPU")


def _cpuinfo_amx() -> bool:
    """AMX-BF16 in /proc/cpuinfo's flags (builds without brisk._C; the kernel lists it only where the
    OS supports the tiles)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "amx_bf16" in line.split() for line in f)
    except OSError:
        return False


def _torch_cpu_isa() -> str:
    """The CPU's level as torch sees it (for builds without brisk._C)."""
    cap = torch.backends.cpu.get_cpu_capability().lower()
    return "avx512" if cap.startswith("avx512") else "avx2" if cap.startswith("avx2") else "scalar"


def requested_isa(cpu_isa: str, env: dict[str, str] | None = None) -> str:
    """The level BRISK_CPU_ISA asks for (the CPU's own when unset); ValueError when it cannot be had."""
    value = (os.environ if env is None else env).get(ISA_ENV, "").strip().lower()
    if value in ("", "native", "auto"):
        return cpu_isa
    if value not in LEVELS:
        raise UserError(f"{ISA_ENV}={value!r} is not an instruction set brisk has: use one of {', '.join(LEVELS)} "
                         "(or unset it for this CPU's best)")
    if LEVELS.index(value) > LEVELS.index(cpu_isa):
        raise UserError(f"{ISA_ENV}={value} asks for more than this CPU offers ({cpu_isa}); use "
                         f"{' or '.join(LEVELS[:LEVELS.index(cpu_isa) + 1])}, or unset it")
    return value


def _requested_switch(name: str, cpu_has: bool, env: dict[str, str] | None, off: str, on: str, absent: str) -> bool:
    """An on/off switch over a CPU feature: unset or "auto" follows the CPU; 0 / 1 (`off` / `on` say
    what each does); 1 where the feature is absent, or another value, is an error at start-up."""
    value = (os.environ if env is None else env).get(name, "").strip().lower()
    if value in ("", "auto"):
        return cpu_has
    if value not in ("0", "1"):
        raise UserError(f"{name}={value!r}: use 0 ({off}) or 1 ({on}), or unset it")
    if value == "1" and not cpu_has:
        raise UserError(f"{name}=1 but {absent}; unset it")
    return value == "1"


def requested_avx_vnni(cpu_has: bool, env: dict[str, str] | None = None) -> bool:
    """Whether BRISK_AVX_VNNI lets the avx2 level use AVX-VNNI (on by default where the CPU has it)."""
    return _requested_switch(AVX_VNNI_ENV, cpu_has, env, "maddubs + madd", "AVX-VNNI", "this CPU has no AVX-VNNI")


def requested_amx(cpu_has: bool, env: dict[str, str] | None = None) -> bool:
    """Whether BRISK_AMX lets batched GGUF block work use AMX-BF16 tiles (on by default where the CPU
    and OS have them)."""
    return _requested_switch(AMX_ENV, cpu_has, env, "integer prompt kernels", "AMX-BF16 tiles",
                             "AMX-BF16 is not usable here (CPU, OS or permission)")


def requested_float_tiles(vendor: str, env: dict[str, str] | None = None) -> bool:
    """Whether K-quant prompt work runs float32 GEMMs on tiles of the weight made float (exact but for
    the sums' order) rather than block_kgemm on x rounded to int8: by default on Intel CPUs, where
    torch's float GEMM was at least as fast (BENCHMARKS.md), not on AMD ones, where MKL's was 0.82x;
    BRISK_FLOAT_PROMPT_TILES=1 / 0 chooses either on any CPU. The MLP's down projections keep float x
    either way (quant/gguf.py FLOAT_X_LINEARS)."""
    value = (os.environ if env is None else env).get(FLOAT_TILES_ENV, "").strip().lower()
    if value in ("", "auto"):
        return vendor == "intel"
    if value not in ("0", "1"):
        raise UserError(f"{FLOAT_TILES_ENV}={value!r}: use 1 (float32 tiles) or 0 (block_kgemm on int8 x), "
                         "or unset it (Intel CPUs: 1, others: 0)")
    return value == "1"


def detect(ext: ModuleType | None, load_error: str | None) -> KernelCaps:
    """Decide the ISA once and tell the extension (before any kernel runs)."""
    if ext is None:
        cpu = _torch_cpu_isa()
        return KernelCaps(False, load_error, cpu, requested_isa(cpu), False, frozenset(), cpu_amx=_cpuinfo_amx())
    cpu = str(ext.cpu_isa()) if hasattr(ext, "cpu_isa") else str(ext.isa())
    isa = requested_isa(cpu)
    if hasattr(ext, "set_isa"):
        ext.set_isa(isa)
    elif isa != cpu:  # a build from before the switch: say so rather than run another ISA than asked
        raise UserError(f"{ISA_ENV}={isa}: this build of brisk._C cannot lower its instruction set; rebuild it "
                         f"({BUILD_HINT})")
    names = frozenset(n for n in dir(ext) if not n.startswith("_"))
    avx_vnni = False
    if "set_avx_vnni" in names:
        ext.set_avx_vnni(requested_avx_vnni(bool(ext.cpu_avx_vnni())))
        avx_vnni = bool(ext.avx_vnni())
    cpu_amx = bool(ext.cpu_amx_bf16()) if "cpu_amx_bf16" in names else _cpuinfo_amx()
    amx = "cpu_amx_bf16" in names and requested_amx(cpu_amx) and str(ext.isa()) == "avx512"
    vendor = str(ext.cpu_vendor()) if "cpu_vendor" in names else "other"
    return KernelCaps(True, None, cpu, str(ext.isa()), bool(ext.have_vnni()) if "have_vnni" in names else False, names,
                      avx_vnni, amx, cpu_amx, vendor, requested_float_tiles(vendor))


def warn_missing(caps: KernelCaps) -> None:
    """Say once, on stderr, that decode runs without brisk's kernels, and how to get them."""
    if not caps.built:
        print(f"brisk: the C++ kernels are not available ({caps.load_error}); decode runs on torch's kernels "
              f"(same results, slower). To build them: {BUILD_HINT}", file=sys.stderr)
