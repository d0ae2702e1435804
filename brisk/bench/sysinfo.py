"""`brisk env`: what this machine is and what brisk runs on it, for bug reports and benchmark notes
(what vLLM's collect_env and llama.cpp's system info print)."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from brisk.kernels.capability import KernelCaps

CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile",
             "amx_bf16", "amx_int8", "neon", "asimd")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields from /proc/cpuinfo (Linux); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def _mem_gib() -> dict[str, float]:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    kib = {line.split(":")[0]: int(line.split()[1]) for line in lines if line.split()[1:2] and line.split()[1].isdigit()}
    return {k: round(kib[name] / 2**20, 1) for k, name in (("total", "MemTotal"), ("available", "MemAvailable"))
            if name in kib}


def copy_bandwidth_gbs(mib: int = 256, repeats: int = 3) -> float:
    """A rough memory-bandwidth hint: the best of `repeats` copies of a `mib` MiB float32 buffer
    (bytes read + written per second). Decode is bandwidth-bound, so this bounds its speed."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return round(2 * src.numel() * 4 / best / 1e9, 1)


def collect(measure_bandwidth: bool = True) -> dict[str, Any]:
    from brisk import kernels

    info = _cpuinfo()
    flags = set(info.get("flags", info.get("Features", "")).split())
    caps = kernels.CAPS
    gpu = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": info.get("model name", platform.processor() or platform.machine()),
        "cpu_flags": sorted(flags & set(CPU_FLAGS)),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": _mem_gib(),
        "copy_bandwidth_gbs": copy_bandwidth_gbs() if measure_bandwidth else None,
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl": torch.backends.mkl.is_available(),
        "onednn": torch.backends.mkldnn.is_available(),
        # which weights oneDNN packs here (bfloat16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT) and
        # whether its int8 matmul is exact (it saturates without VNNI): both change which path runs
        "onednn_packed_dtypes": sorted(str(d).removeprefix("torch.") for d in kernels.PACK_DTYPES),
        "onednn_int8_matmul": kernels.HAVE_ONEDNN_QLINEAR,
        "kernels_built": caps.built,
        "kernels_error": caps.load_error,
        "isa_cpu": caps.cpu_isa,
        "isa_in_use": caps.isa,
        "isa_env": os.environ.get("BRISK_CPU_ISA") or None,
        "vnni_kernels": caps.vnni,
        # the avx2 level's block, group and W8A8 kernels on AVX-VNNI (BRISK_AVX_VNNI)
        "avx_vnni_kernels": caps.avx_vnni,
        "amx_bf16_cpu": caps.cpu_amx,  # AMX-BF16 usable here (oneDNN's bf16 GEMMs run on it)
        "amx_prompt_tiles": caps.amx,  # GGUF blocks' prompt work as bf16 tiles on it (BRISK_AMX)
        "cpu_vendor": caps.vendor,  # the K-quant prompt path follows it (kernels.float_prompt_tiles)
        "kquant_prompt": _kquant_prompt(caps),
        "kernels": sorted(caps.names - {"isa", "cpu_isa", "set_isa", "have_vnni", "cpu_avx_vnni", "avx_vnni",
                                        "set_avx_vnni", "cpu_amx_bf16", "cpu_vendor"}),
        # the virtual KV layout's committed memory is read with mincore, which gVisor cannot answer
        "vmem_residency": _vmem_residency(),
        "cuda_gpus": gpu,
    }


def _vmem_residency() -> str:
    """Whether the virtual KV layout's committed memory can be read here (runtime/virtual_kv.py)."""
    from brisk import kernels

    unavailable = kernels.vmem_unavailable()
    if unavailable is not None:
        return f"no virtual KV layout here: {unavailable}"
    from brisk.runtime.virtual_kv import residency_readable

    if residency_readable():
        return "readable (mincore)"
    return "unreadable (mincore reports reserved pages resident, as under gVisor): bench kv counts committed tiles"


def _kquant_prompt(caps: KernelCaps) -> str:
    """What K-quant prompt work runs on (quant/gguf.py BlockLinear._batched; BRISK_AMX, BRISK_FLOAT_PROMPT_TILES)."""
    from brisk import kernels

    if not caps.built:
        return "torch (no kernels)"
    if caps.amx:
        return "bf16 tiles (AMX)"
    if kernels.float_prompt_tiles():
        return "float32 tiles"
    # the MLP's down projections keep float x where the tiles can be made float (gguf.FLOAT_X_LINEARS)
    return "int8 block_kgemm (MLP down: float32 tiles)" if kernels.block_dequantize_supported() else "int8 block_kgemm"


def render(env: dict[str, Any]) -> str:
    """The same facts as aligned `key: value` lines."""
    width = max(len(k) for k in env)
    lines = []
    for key, value in env.items():
        if isinstance(value, dict):
            value = [f"{v} {k}" for k, v in value.items()]
        shown = ", ".join(map(str, value)) if isinstance(value, list) else value
        lines.append(f"{key.ljust(width)}  {shown if shown not in (None, '') else '-'}")
    return "\n".join(lines)
