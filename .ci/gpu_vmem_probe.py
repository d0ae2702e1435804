"""What CUDA's virtual memory management costs on the lent GPU (issue 23's CUDA part, measured before
building on it): granularity, reserve / create+map+access / unmap+release times per page, and whether
a torch tensor over a reserved range reads and writes (through __cuda_array_interface__).

    python3 .ci/gpu_vmem_probe.py [--pages 256]   # prints one JSON line

Needs cuda-python's driver bindings (`cuda.bindings.driver`, in the GPU image); nothing of brisk.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=256)
    args = ap.parse_args()
    from cuda.bindings import driver as cu

    def ck(result):  # type: ignore[no-untyped-def]
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver call failed: {err}")
        return rest[0] if len(rest) == 1 else rest

    torch.zeros(1, device="cuda")  # the runtime's primary context, current on this thread
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = torch.cuda.current_device()
    flags = cu.CUmemAllocationGranularity_flags
    minimum = int(ck(cu.cuMemGetAllocationGranularity(prop, flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
    recommended = int(ck(cu.cuMemGetAllocationGranularity(prop, flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)))
    page = minimum
    reserve_bytes = 1 << 40  # 1 TiB of address space
    t0 = time.perf_counter()
    base = int(ck(cu.cuMemAddressReserve(reserve_bytes, 0, 0, 0)))
    reserve_ms = (time.perf_counter() - t0) * 1e3
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = prop.location.id
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    handles, map_us = [], []
    for i in range(args.pages):
        t0 = time.perf_counter()
        h = ck(cu.cuMemCreate(page, prop, 0))
        ck(cu.cuMemMap(base + i * page, page, 0, h, 0))
        ck(cu.cuMemSetAccess(base + i * page, page, [access], 1))
        map_us.append((time.perf_counter() - t0) * 1e6)
        handles.append(h)

    class Range:  # a torch tensor over the mapped bytes, no copy
        __cuda_array_interface__ = {"shape": (args.pages * page,), "typestr": "|u1", "data": (base, False),
                                    "version": 3, "strides": None}

    t = torch.as_tensor(Range(), device="cuda")
    t.fill_(3)
    ok = int(t.view(torch.int32)[:1024].sum().item()) == 1024 * 0x03030303 and t.data_ptr() == base
    words = t.view(torch.int32)  # every word its index: exact at any size (float32 stops at 2^24)
    words.copy_(torch.arange(words.numel(), device="cuda", dtype=torch.int32))
    torch.cuda.synchronize()
    ok = ok and torch.equal(words[::4099].cpu(), torch.arange(0, words.numel(), 4099, dtype=torch.int32))
    unmap_us = []
    for i, h in enumerate(handles):
        t0 = time.perf_counter()
        ck(cu.cuMemUnmap(base + i * page, page))
        ck(cu.cuMemRelease(h))
        unmap_us.append((time.perf_counter() - t0) * 1e6)
    ck(cu.cuMemAddressFree(base, reserve_bytes))
    map_us.sort()
    unmap_us.sort()
    print(json.dumps({"granularity_min": minimum, "granularity_recommended": recommended,
                      "reserve_1tib_ms": round(reserve_ms, 3), "pages": args.pages,
                      "map_us_p50": round(map_us[len(map_us) // 2], 1), "map_us_max": round(map_us[-1], 1),
                      "unmap_us_p50": round(unmap_us[len(unmap_us) // 2], 1),
                      "tensor_reads_and_writes": ok}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
