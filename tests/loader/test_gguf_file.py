"""The GGUF file's memory map: the pages under rows a loader has copied are let go, and nothing else."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from brisk.loader.gguf_loader import open_gguf

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and MADV_DONTNEED are Linux's")


def _mapped_kib(path: Path) -> int:
    """This process's resident KiB of its mappings of `path` (/proc/self/smaps: mincore would report
    the page cache, which keeps the file's pages either way)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
            inside = len(fields) >= 6 and Path(fields[5]) == path.resolve()
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def test_release_bytes_lets_the_maps_pages_go_and_leaves_other_memory_alone(gguf_path: Path) -> None:
    file = open_gguf(gguf_path)
    t = max(file.reader.tensors, key=lambda info: info.n_bytes)  # the embedding: many pages
    data = np.asarray(t.data)
    before = _mapped_kib(gguf_path)
    copy = data.copy()  # reading every byte maps every page
    address, n = data.ctypes.data, data.nbytes
    if _mapped_kib(gguf_path) == before:
        pytest.skip("this system's smaps does not show a file map's pages as they are read (as under gVisor)")
    assert _mapped_kib(gguf_path) - before >= 0.9 * n / 1024
    file.reader.release_bytes(address, n)
    # the edge pages (shared with the neighbours) stay, and with them whatever the kernel mapped around
    # them (fault-around: up to 64 KiB each side); a kernel mapping the file in huge pages drops more
    assert _mapped_kib(gguf_path) - before <= 2 * 64 + 2 * mmap.PAGESIZE / 1024
    assert np.array_equal(data, copy)  # the page cache still holds the file: reading maps them back
    anonymous = torch.arange(1 << 20, dtype=torch.int32)  # not the map's: MADV_DONTNEED would zero it
    file.reader.release_bytes(anonymous.data_ptr(), anonymous.numel() * 4)
    assert torch.equal(anonymous, torch.arange(1 << 20, dtype=torch.int32))
