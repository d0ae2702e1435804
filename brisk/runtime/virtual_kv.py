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
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from brisk import kernels
from brisk.core.kv_manager import MemoryOp
from brisk.errors import UserError
from brisk.model.attention import KVCache
from brisk.model.base import CausalLM

MAX_RESERVATION = 1 << 46  # 64 TiB of address space in all: x86-64 user space is 128 TiB


def check_available() -> None:
    """A clear error where the virtual layout cannot run (no extension, not Linux)."""
    reason = kernels.vmem_unavailable()
    if reason is not None:
        raise UserError(f"kv_layout='virtual' needs brisk's C++ extension with its virtual-memory calls: "
                         f"{reason}; use kv_layout='paged' (--kv-layout paged)")


class VirtualKV:
    """Reserved keys and values of every layer (module docstring); None for another stage's layers."""

    def __init__(self, model: CausalLM, num_rows: int, row_tiles: int, tile: int, huge_pages: bool = False) -> None:
        check_available()
        cfg = model.config
        if model.device.type != "cpu":
            raise UserError("kv_layout='virtual' runs on CPU (CUDA virtual memory is not built yet); "
                             "use kv_layout='paged'")
        self.num_rows, self.row_tiles, self.tile = num_rows, row_tiles, tile
        itemsize = torch.tensor([], dtype=model.dtype).element_size()
        heads = model.kv_heads_per_layer()
        self.tile_bytes = [0 if h is None else h * cfg.head_dim * tile * itemsize for h in heads]  # per tensor
        total = 2 * sum(self.tile_bytes) * num_rows * row_tiles
        if total > MAX_RESERVATION:
            raise UserError(f"the virtual KV layout would reserve {total / 2**40:.1f} TiB of address space "
                             f"(max_num_seqs {num_rows} x max_model_len {row_tiles * tile}); lower max_num_seqs or "
                             "max_model_len, or use kv_layout='paged'")
        page = kernels.vmem_page_size()
        bad = sorted({b for b in self.tile_bytes if b % page})
        if bad:
            raise UserError(f"a KV tile of {tile} tokens is {bad[0]} bytes per layer, not whole {page}-byte pages; "
                             f"use a block_size that makes it whole pages (e.g. {self.tile_for(model, tile)})")
        self.buffers: list[torch.Tensor] = []  # uint8 reservations, two per layer (keys, values)
        self.kv_caches: list[KVCache | None] = [
            None if h is None else self._layer(h, cfg.head_dim, model.dtype, b, huge_pages)
            for h, b in zip(heads, self.tile_bytes)]
        self._buffer_tile_bytes = [b for b in self.tile_bytes if b for _ in (0, 1)]
        self._ahead: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self.alloc_seconds = 0.0  # spent committing and releasing on the step's thread
        self.commit_thread_ids: set[int] = set()  # the commit-ahead thread (its page faults are not the step's)
        self.ahead_thread = (os.cpu_count() or 1) > torch.get_num_threads()

    @staticmethod
    def tile_for(model: CausalLM, block_size: int) -> int:
        """`block_size`, doubled until one tile of every layer's keys is whole pages (a row
        commits tile by tile, so a tile must not share a page with the next)."""
        check_available()
        page = kernels.vmem_page_size()
        itemsize = torch.tensor([], dtype=model.dtype).element_size()
        sizes = {h * model.config.head_dim * itemsize for h in model.kv_heads_per_layer() if h is not None}
        tile = block_size
        while any((b * tile) % page for b in sizes):
            tile *= 2
        return tile

    def _layer(self, heads: int, head_dim: int, dtype: torch.dtype, tile_bytes: int, huge_pages: bool) -> KVCache:
        n = self.num_rows * self.row_tiles
        k_buf, v_buf = kernels.vmem_reserve(n * tile_bytes, huge_pages), kernels.vmem_reserve(n * tile_bytes, huge_pages)
        self.buffers += [k_buf, v_buf]
        keys = k_buf.view(dtype).view(n, heads, head_dim, self.tile)  # [tiles, n_kv, hd, tile]
        values = v_buf.view(dtype).view(n, heads, self.tile, head_dim)  # [tiles, n_kv, tile, hd]
        return keys, values

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
        later = [op for op in ops if op.ahead and self.ahead_thread]
        self._run_all([op for op in ops if not (op.ahead and self.ahead_thread)])
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
        for op in ops:
            self._run(op)

    def _run(self, op: MemoryOp) -> None:
        call = kernels.vmem_populate if op.kind == "populate" else kernels.vmem_release
        for buf, tile_bytes in zip(self.buffers, self._buffer_tile_bytes):
            call(buf, (op.row * self.row_tiles + op.first) * tile_bytes, op.count * tile_bytes)

    def release_all(self) -> None:
        """Give back every page (nothing runs: e.g. after start-up measurements wrote scratch KV)."""
        self.wait()
        for buf in self.buffers:
            kernels.vmem_release(buf, 0, buf.numel())

    # ----------------------------------------------------------------------------- measurements

    def resident_bytes(self) -> int:
        """Bytes of every reservation backed by physical memory now (mincore)."""
        self.wait()
        return sum(kernels.vmem_resident(b, 0, b.numel()) for b in self.buffers)

    @property
    def bytes_per_tile(self) -> int:
        """One tile of keys and values in every layer: the unit the manager's budget counts."""
        return 2 * sum(self.tile_bytes)
