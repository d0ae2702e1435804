"""The virtual KV layout's tensors: per layer, keys and values over reserved address space.

Each layer's keys (and values) are one reservation of `num_rows x row_tiles` tiles (the C++
extension's `vmem_reserve`: mmap with MAP_NORESERVE, no physical memory until written). Tile
`r * row_tiles + t` is tokens `t * tile ..` of row r, laid out as a paged block (keys
`[kv_heads, head_dim, tile]`, values `[kv_heads, tile, head_dim]`), so the paged kernel, the
decode plan and the gather path read a row through a table of consecutive ids, and long prefill
chunks read it as one slice (no gather):

    keys of layer l:  | row 0: tile 0 | tile 1 | ... | row 1: tile 0 | ...     one mmap, 4 KB pages
                        [heads, hd, tile] = whole pages (checked), so rows commit tile by tile

The manager (core/virtual_kv.py) decides which tiles are committed; `apply` carries its
decisions out: `populate` (madvise MADV_POPULATE_WRITE, before the forward for the tiles this
step writes; for tiles ahead on a worker thread beside it where a core is spare) and `release`
(MADV_DONTNEED).

Where the pages come from is a backing (`HostPages`: the C++ extension's mmap, 4 KB or 2 MB
transparent huge pages, tiles whole pages so a tile's commit is exact; `CudaPages`: CUDA's virtual
memory management, cuMemAddressReserve / cuMemCreate / cuMemMap of 2 MiB pages). A CUDA page holds
many tiles of a row (~340 of SmolLM2's 16-token bfloat16 tiles, 6 KiB each), so `DevicePages` maps a page while any committed tile
touches it and unmaps it when the last one is released; the manager counts the same pages against
the budget (core/virtual_kv.PageModel), so committed memory never exceeds it, whatever the pages
hold beyond the tokens' tiles (up to a page per row's committed run and tensor).
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from brisk import kernels
from brisk.core.kv_manager import MemoryOp
from brisk.core.virtual_kv import PageModel, run_pages
from brisk.errors import UserError
from brisk.model.attention import KVCache
from brisk.model.base import CausalLM

MAX_RESERVATION = 1 << 46  # 64 TiB of address space in all: x86-64 user space is 128 TiB
ADDRESS_HEADROOM = 1 << 30  # kept free of reservations under `ulimit -v`


def address_room(host: bool = True) -> tuple[int, str]:
    """Address space the reservations may take, and what bounds it: brisk's own cap (x86-64 user
    space is 128 TiB), or on the host less under a process limit (`ulimit -v`: RLIMIT_AS), less
    what the process maps already (a device's address space is the driver's, cuMemAddressReserve)."""
    room, where = MAX_RESERVATION, "brisk's cap on reserved address space"
    if not host:
        return room, where
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, ValueError, OSError):
        return room, where
    if soft != resource.RLIM_INFINITY:
        # what the limit leaves, less headroom for what the process maps after (buffers, threads)
        left = soft - _mapped_bytes() - ADDRESS_HEADROOM
        if left < room:
            room, where = max(0, left), "what this process's address-space limit (ulimit -v) leaves, less 1 GiB"
    return room, where


def _mapped_bytes() -> int:
    """Address space this process maps now (VmSize), 0 where /proc cannot say."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**40:.1f} TiB" if nbytes >= 2**40 else f"{nbytes / 2**30:.1f} GiB"


def check_available() -> None:
    """A clear error where the virtual layout cannot run on the CPU (no extension, not Linux)."""
    reason = kernels.vmem_unavailable()
    if reason is not None:
        raise UserError(f"kv_layout='virtual' needs brisk's C++ extension with its virtual-memory calls: "
                         f"{reason}; use kv_layout='paged' (--kv-layout paged)")


class Backing(Protocol):
    """Reserved address space and the physical pages behind it, for one device."""

    page: int  # bytes of the unit memory is committed in
    exact: bool  # tiles must be whole pages (a commit is exactly the tiles'), else pages are shared
    ahead_thread: bool  # commits ahead may run on a worker thread beside the forward

    def reserve(self, nbytes: int, huge_pages: bool) -> torch.Tensor: ...
    def populate(self, buf: torch.Tensor, tile_bytes: int, first: int, count: int) -> None: ...
    def release(self, buf: torch.Tensor, tile_bytes: int, first: int, count: int) -> None: ...
    def release_all(self, buf: torch.Tensor) -> None: ...
    def resident(self, buf: torch.Tensor) -> int | None: ...  # None: the OS cannot tell here
    def close(self) -> None: ...


@functools.cache
def residency_readable() -> bool:
    """Whether mincore tells committed pages from reserved ones on this system: gVisor's (Cloud
    Run, GKE Sandbox) reports every page of a mapping resident, touched or not, so a fresh
    reservation reading as resident means residency cannot be measured here."""
    try:
        probe = kernels.vmem_reserve(16 * kernels.vmem_page_size(), False)
        return kernels.vmem_resident(probe, 0, probe.numel()) == 0
    except RuntimeError:  # no such calls here (not Linux): nothing to read either
        return False


class HostPages:
    """The CPU's pages through the C++ extension (kernels/cpu_vmem.cpp): mmap MAP_NORESERVE,
    MADV_POPULATE_WRITE, MADV_DONTNEED, mincore. The reservations are unmapped with their tensors."""

    exact = True

    def __init__(self) -> None:
        check_available()
        self.page = kernels.vmem_page_size()
        self.ahead_thread = (os.cpu_count() or 1) > torch.get_num_threads()

    def reserve(self, nbytes: int, huge_pages: bool) -> torch.Tensor:
        try:
            return kernels.vmem_reserve(nbytes, huge_pages)
        except RuntimeError as exc:  # the extension's message names the failed call and the fallback
            raise UserError(str(exc).splitlines()[0]) from None

    def populate(self, buf: torch.Tensor, tile_bytes: int, first: int, count: int) -> None:
        kernels.vmem_populate(buf, first * tile_bytes, count * tile_bytes)

    def release(self, buf: torch.Tensor, tile_bytes: int, first: int, count: int) -> None:
        kernels.vmem_release(buf, first * tile_bytes, count * tile_bytes)

    def release_all(self, buf: torch.Tensor) -> None:
        kernels.vmem_release(buf, 0, buf.numel())

    def resident(self, buf: torch.Tensor) -> int | None:
        return kernels.vmem_resident(buf, 0, buf.numel()) if residency_readable() else None

    def close(self) -> None:
        pass


@dataclass
class _Reservation:
    base: int  # device address
    nbytes: int  # whole pages
    tiles: list[int]  # per page: committed tiles touching it
    handles: dict[int, Any] = field(default_factory=dict)  # mapped page -> the driver's allocation


class DevicePages:
    """Pages larger than a tile (CUDA's 2 MiB): a page is mapped while any committed tile touches
    it. The manager commits and releases every tile exactly once, in runs of any grouping, so the
    count per page is of tiles, not of calls. Subclasses map and unmap one page."""

    exact = False
    ahead_thread = False  # the driver's calls need the device's context; they run on the step's thread

    def __init__(self, page: int) -> None:
        self.page = page
        self._reservations: dict[int, _Reservation] = {}  # the tensor's data_ptr -> its pages

    def reserve(self, nbytes: int, huge_pages: bool) -> torch.Tensor:
        if huge_pages:
            raise UserError("kv_huge_pages is for the CPU's transparent huge pages; a GPU's virtual layout "
                             f"commits {self.page >> 20} MiB pages already: leave kv_huge_pages off")
        size = -(-nbytes // self.page) * self.page
        base = self._reserve(size)
        self._reservations[base] = _Reservation(base, size, [0] * (size // self.page))
        return self._tensor(base, size)

    def populate(self, buf: torch.Tensor, tile_bytes: int, first: int, count: int) -> None:
        """Map the pages tiles [first, first + count) touch that no committed tile did, zeroed
        (fresh device memory holds anything; masked slots are still read, and 0 x NaN is NaN);
        on a failure nothing of this call stays mapped or counted."""
        self._enter()
        r = self._reservations[buf.data_ptr()]
        done: list[tuple[int, int]] = []
        try:
            for page, tiles in self._pages(tile_bytes, first, count):
                if not r.tiles[page]:
                    r.handles[page] = self._map(r.base + page * self.page)
                    buf[page * self.page:(page + 1) * self.page].zero_()
                r.tiles[page] += tiles
                done.append((page, tiles))
        except BaseException:
            for page, tiles in done:
                r.tiles[page] -= tiles
            for page in [p for p in r.handles if not r.tiles[p]]:  # mapped here (zeroing may have failed)
                self._unmap(r.base + page * self.page, r.handles.pop(page))
            raise

    def release(self, buf: torch.Tensor, tile_bytes: int, first: int, count: int) -> None:
        self._enter()
        r = self._reservations[buf.data_ptr()]
        synced = False
        for page, tiles in self._pages(tile_bytes, first, count):
            assert r.tiles[page] >= tiles, "a tile released twice"
            r.tiles[page] -= tiles
            if not r.tiles[page]:
                if not synced:  # kernels queued before may still read the page
                    self._sync()
                    synced = True
                self._unmap(r.base + page * self.page, r.handles.pop(page))

    def release_all(self, buf: torch.Tensor) -> None:
        self._enter()
        r = self._reservations[buf.data_ptr()]
        if r.handles:
            self._sync()
        for page, handle in sorted(r.handles.items()):
            self._unmap(r.base + page * self.page, handle)
        r.handles.clear()
        r.tiles = [0] * len(r.tiles)

    def resident(self, buf: torch.Tensor) -> int:
        return len(self._reservations[buf.data_ptr()].handles) * self.page

    def close(self) -> None:
        """Unmap every page and free every reservation (the tensors over them must be gone)."""
        if not self._reservations:
            return
        self._enter()
        if any(r.handles for r in self._reservations.values()):
            self._sync()
        for r in self._reservations.values():
            for page, handle in sorted(r.handles.items()):
                self._unmap(r.base + page * self.page, handle)
            self._free(r.base, r.nbytes)
        self._reservations.clear()

    def _pages(self, tile_bytes: int, first: int, count: int) -> list[tuple[int, int]]:
        """(page, how many of tiles [first, first + count) touch it): `run_pages`, the pages the
        manager's PageModel counts."""
        return run_pages(first, count, tile_bytes, self.page)

    # ---- the device's calls
    def _enter(self) -> None:
        """Make the device's context current on the calling thread (the server steps on its own)."""
    def _reserve(self, nbytes: int) -> int: raise NotImplementedError
    def _tensor(self, base: int, nbytes: int) -> torch.Tensor: raise NotImplementedError
    def _map(self, address: int) -> Any: raise NotImplementedError
    def _unmap(self, address: int, handle: Any) -> None: raise NotImplementedError
    def _free(self, base: int, nbytes: int) -> None: raise NotImplementedError
    def _sync(self) -> None: raise NotImplementedError


class CudaPages(DevicePages):
    """CUDA's virtual memory management through cuda-python's driver bindings (as measured by
    .ci/gpu_vmem_probe.py): one reservation per tensor, a cuMemCreate + cuMemMap + cuMemSetAccess
    per page (cuMemUnmap cannot unmap part of a mapping, so pages are mapped one by one), and a
    torch tensor over the range through __cuda_array_interface__ (no copy, not owned: `close`
    frees it)."""

    def __init__(self, device: torch.device) -> None:
        try:
            from cuda.bindings import driver as cu
        except ImportError:
            raise UserError("kv_layout='virtual' on CUDA needs cuda-python's driver bindings "
                             "(pip install cuda-python, or brisk's extra: pip install -e '.[cuda]'); or use kv_layout='paged' "
                             "(--kv-layout paged)") from None
        self.cu, self.device = cu, torch.device("cuda", torch.cuda.current_device() if device.index is None
                                                 else device.index)
        torch.zeros(1, device=self.device)  # the runtime's primary context, current on this thread
        # kept to make current on whichever thread commits pages later (the server's engine thread,
        # a finalizer): the driver's calls act on the calling thread's current context
        self.context = self._ck(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device.index
        self.prop = prop
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device.index
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access = access
        minimum = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        super().__init__(int(self._ck(cu.cuMemGetAllocationGranularity(prop, minimum), "cuMemGetAllocationGranularity")))

    def _ck(self, result: Any, call: str) -> Any:
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise UserError(f"CUDA's {call} failed ({err}) for the virtual KV layout: lower kv_cache_memory_gib, "
                             "max_num_seqs or max_model_len, or use kv_layout='paged' (--kv-layout paged)")
        return rest[0] if len(rest) == 1 else rest

    def _reserve(self, nbytes: int) -> int:
        return int(self._ck(self.cu.cuMemAddressReserve(nbytes, 0, 0, 0), "cuMemAddressReserve"))

    def _tensor(self, base: int, nbytes: int) -> torch.Tensor:
        class Range:
            __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (base, False),
                                        "version": 3, "strides": None}
        return torch.as_tensor(Range(), device=self.device)

    def _enter(self) -> None:
        self._ck(self.cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def _map(self, address: int) -> Any:
        created = self.cu.cuMemCreate(self.page, self.prop, 0)
        if created[0] == self.cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            torch.cuda.empty_cache()  # blocks torch's allocator keeps cached are memory the driver cannot give
            created = self.cu.cuMemCreate(self.page, self.prop, 0)
        handle = self._ck(created, "cuMemCreate")
        try:
            self._ck(self.cu.cuMemMap(address, self.page, 0, handle, 0), "cuMemMap")
            self._ck(self.cu.cuMemSetAccess(address, self.page, [self.access], 1), "cuMemSetAccess")
        except UserError:
            self.cu.cuMemUnmap(address, self.page)
            self.cu.cuMemRelease(handle)
            raise
        return handle

    def _unmap(self, address: int, handle: Any) -> None:
        self._ck(self.cu.cuMemUnmap(address, self.page), "cuMemUnmap")
        self._ck(self.cu.cuMemRelease(handle), "cuMemRelease")

    def _free(self, base: int, nbytes: int) -> None:
        self._ck(self.cu.cuMemAddressFree(base, nbytes), "cuMemAddressFree")

    def _sync(self) -> None:
        torch.cuda.synchronize(self.device)


def default_backing(device: torch.device) -> Backing:
    """The pages of `device`: the CPU's through the extension, CUDA's through its driver."""
    if device.type == "cpu":
        return HostPages()
    if device.type == "cuda":
        return CudaPages(device)
    raise UserError(f"kv_layout='virtual' runs on the CPU and CUDA, not {device.type}; use kv_layout='paged'")


class VirtualKV:
    """Reserved keys and values of every layer (module docstring); None for another stage's layers."""

    def __init__(self, model: CausalLM, num_rows: int, row_tiles: int, tile: int, huge_pages: bool = False,
                 backing: Backing | None = None) -> None:
        """`backing`: where the pages come from (None: the model's device's, `default_backing`)."""
        cfg = model.config
        self.backing = backing = backing or default_backing(model.device)
        self.num_rows, self.row_tiles, self.tile = num_rows, row_tiles, tile
        itemsize = torch.tensor([], dtype=model.dtype).element_size()
        heads = model.kv_heads_per_layer()
        self.tile_bytes = [0 if h is None else h * cfg.head_dim * tile * itemsize for h in heads]  # per tensor
        total = 2 * sum(self.tile_bytes) * num_rows * row_tiles
        room, where = address_room(host=backing.exact)
        if total > room:
            raise UserError(f"the virtual KV layout would reserve {_size(total)} of address space (max_num_seqs "
                             f"{num_rows} x max_model_len {row_tiles * tile}), more than {where} ({_size(room)}); "
                             "lower max_num_seqs or max_model_len, or use kv_layout='paged' (--kv-layout paged)")
        page = backing.page
        bad = sorted({b for b in self.tile_bytes if b % page}) if backing.exact else []
        if bad:
            raise UserError(f"a KV tile of {tile} tokens is {bad[0]} bytes per layer, not whole {page}-byte pages; "
                             f"use a block_size that makes it whole pages (e.g. {self.tile_for(model, tile, backing)})")
        self.buffers: list[torch.Tensor] = []  # uint8 reservations, two per layer (keys, values)
        # freed when this object goes (a device's reservations are not owned by their tensors)
        self._closer = weakref.finalize(self, backing.close)
        self._closer.atexit = False  # at exit the process gives everything back, maybe under a running forward
        self.kv_caches: list[KVCache | None] = []
        try:
            for h, b in zip(heads, self.tile_bytes):
                self.kv_caches.append(None if h is None else self._layer(h, cfg.head_dim, model.dtype, b, huge_pages))
        except BaseException:
            # a later layer's reservation failed: the earlier ones go with their last reference (a
            # reservation is unmapped with its tensor; a device's, by the backing's close)
            self.kv_caches, self.buffers = [], []
            self._closer()
            raise
        self._buffer_tile_bytes = [b for b in self.tile_bytes if b for _ in (0, 1)]
        self._ahead: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self.alloc_seconds = 0.0  # spent committing and releasing on the step's thread
        self.commit_thread_ids: set[int] = set()  # the commit-ahead thread (its page faults are not the step's)
        self.ahead_thread = backing.ahead_thread
        self._unbacked: set[int] = set()  # tiles whose commit failed, until take_unbacked
        self.commit_error: BaseException | None = None  # the last commit's failure
        self.release_errors = 0  # releases the OS refused (warned once)

    @staticmethod
    def tile_for(model: CausalLM, block_size: int, backing: Backing) -> int:
        """`block_size`, doubled until one tile of every layer's keys is whole pages (a row
        commits tile by tile, so a tile must not share a page with the next); where pages hold
        many tiles (CUDA's 2 MiB, shared pages) `block_size` stays."""
        if not backing.exact:
            return block_size
        itemsize = torch.tensor([], dtype=model.dtype).element_size()
        sizes = {h * model.config.head_dim * itemsize for h in model.kv_heads_per_layer() if h is not None}
        tile = block_size
        while any((b * tile) % backing.page for b in sizes):
            tile *= 2
        return tile

    def _layer(self, heads: int, head_dim: int, dtype: torch.dtype, tile_bytes: int, huge_pages: bool) -> KVCache:
        n = self.num_rows * self.row_tiles
        k_buf = self.backing.reserve(n * tile_bytes, huge_pages)
        self.buffers.append(k_buf)
        v_buf = self.backing.reserve(n * tile_bytes, huge_pages)
        self.buffers.append(v_buf)
        # a device's reservation is whole pages: the tensors take the tiles' bytes of it
        keys = k_buf[:n * tile_bytes].view(dtype).view(n, heads, head_dim, self.tile)  # [tiles, n_kv, hd, tile]
        values = v_buf[:n * tile_bytes].view(dtype).view(n, heads, self.tile, head_dim)  # [tiles, n_kv, tile, hd]
        return keys, values

    @staticmethod
    def row_tiles_for(model: CausalLM, tokens: int, tile: int, backing: Backing) -> int:
        """Tiles a row of `tokens` takes: where pages hold many tiles, rounded up so that every
        tensor's row is whole pages (no page holds two rows' tiles)."""
        row_tiles = -(-tokens // tile)
        if backing.exact:
            return row_tiles
        itemsize = torch.tensor([], dtype=model.dtype).element_size()
        step = 1
        for h in {h for h in model.kv_heads_per_layer() if h is not None}:
            tile_bytes = h * model.config.head_dim * tile * itemsize
            need = backing.page // math.gcd(backing.page, tile_bytes)  # tiles that make whole pages
            step = step * need // math.gcd(step, need)
        return -(-row_tiles // step) * step

    def page_model(self) -> PageModel | None:
        """Where pages hold many tiles, the manager's model of them (the same pages DevicePages
        maps); None where tiles are whole pages."""
        if self.backing.exact:
            return None
        sizes: dict[int, int] = {}
        for size in self._buffer_tile_bytes:
            sizes[size] = sizes.get(size, 0) + 1
        return PageModel(self.backing.page, sizes)

    # ----------------------------------------------------------------------------- memory ops

    def apply(self, ops: Sequence[MemoryOp]) -> None:
        """Carry out the manager's decisions in order: this step's commits and every release now,
        commits ahead on the worker thread (which finishes before the next call's ops) where
        the CPU has a core torch does not use, else now too: on 2 cores with torch on both the
        thread slowed the forward more than the faults it took off it (BENCHMARKS.md, KV layouts)."""
        self.wait()
        if not ops:
            return
        started = time.perf_counter()
        # a tile committed ahead and given back within the same ops (room made for another
        # request) is committed now, in order, before its release: the worker would run it after
        released = {(op.row, op.first + i) for op in ops if op.kind == "release" for i in range(op.count)}
        now: list[MemoryOp] = []
        later: list[MemoryOp] = []
        for op in ops:
            deferred = op.ahead and self.ahead_thread and released.isdisjoint(
                (op.row, op.first + i) for i in range(op.count))
            (later if deferred else now).append(op)
        self._run_all(now)
        self.alloc_seconds += time.perf_counter() - started
        if later:
            if self._ahead is None:
                self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="brisk-kv-commit",
                                                 initializer=lambda: self.commit_thread_ids.add(threading.get_native_id()))
            self._pending = self._ahead.submit(self._run_all, later)

    def wait(self) -> None:
        """Let the commits ahead finish (their errors surface here)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _run_all(self, ops: list[MemoryOp]) -> None:
        """Each op in order; a commit that fails (out of memory) leaves its tiles unbacked in every
        tensor and is reported by `take_unbacked` instead of raising, and a later release skips
        the unbacked tiles it names (nothing of them is committed)."""
        for op in ops:
            first = op.row * self.row_tiles + op.first
            tiles = range(first, first + op.count)
            if op.kind == "populate":
                try:
                    self._populate(first, op.count)
                except (RuntimeError, OSError, MemoryError, UserError) as exc:
                    self._unbacked.update(tiles)
                    self.commit_error = exc
                continue
            if self._unbacked.isdisjoint(tiles):
                self._release_quietly(first, op.count)
                continue
            run: list[int] = []
            for tile in [*tiles, None]:  # the named tiles that are backed, as runs
                if tile is not None and tile not in self._unbacked:
                    run.append(tile)
                    continue
                if run:
                    self._release_quietly(run[0], len(run))
                run = []
            self._unbacked.difference_update(tiles)

    def _populate(self, first: int, count: int) -> None:
        """Commit tiles [first, first + count) in every tensor, or in none."""
        done = 0
        try:
            for buf, tile_bytes in zip(self.buffers, self._buffer_tile_bytes):
                self.backing.populate(buf, tile_bytes, first, count)
                done += 1
        except BaseException:
            for buf, tile_bytes in list(zip(self.buffers, self._buffer_tile_bytes))[:done]:
                self.backing.release(buf, tile_bytes, first, count)
            raise

    def _release(self, first: int, count: int) -> None:
        for buf, tile_bytes in zip(self.buffers, self._buffer_tile_bytes):
            self.backing.release(buf, tile_bytes, first, count)

    def _release_quietly(self, first: int, count: int) -> None:
        """Give tiles back; where the host's OS refuses (it should not: madvise MADV_DONTNEED fails
        only on a bad range), the pages stay committed until the row is reused or the engine
        closes, and the step goes on: a release that fails loses no request. A device's failure
        (a CUDA error, sticky) is raised: its page bookkeeping cannot be trusted after it."""
        if not self.backing.exact:
            self._release(first, count)
            return
        try:
            self._release(first, count)
        except (RuntimeError, OSError) as exc:
            self.release_errors += 1
            if self.release_errors == 1:
                warnings.warn(f"virtual KV: giving pages back failed ({str(exc).splitlines()[0]}); they stay "
                              "committed, requests go on", RuntimeWarning, stacklevel=2)

    def take_unbacked(self) -> tuple[list[int], BaseException | None]:
        """Tiles (ids) the manager counts as committed whose commit failed since the last call, and
        the last failure: the engine ends the requests that name them and un-counts them."""
        self.wait()
        tiles, self._unbacked = sorted(self._unbacked), set()
        return tiles, self.commit_error

    def release_all(self) -> None:
        """Give back every page (nothing runs: e.g. after start-up measurements wrote scratch KV)."""
        self.wait()
        for buf in self.buffers:
            self.backing.release_all(buf)

    # ----------------------------------------------------------------------------- measurements

    def resident_bytes(self) -> int | None:
        """Bytes of every reservation backed by physical memory now (mincore); None where the OS
        cannot tell (`residency_readable`)."""
        self.wait()
        counts = [self.backing.resident(b) for b in self.buffers]
        return None if None in counts else sum(c for c in counts if c is not None)

    @property
    def bytes_per_tile(self) -> int:
        """One tile of keys and values in every layer: the unit the manager's budget counts."""
        return 2 * sum(self.tile_bytes)
