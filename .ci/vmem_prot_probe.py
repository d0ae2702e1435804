"""PROT_NONE reservation + mprotect per commit vs a read-write MAP_NORESERVE reservation: commit time
and the mappings (VMAs) it leaves, for 32 rows x 60 tensors growing tile by tile."""
import ctypes, mmap, os, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
PROT_NONE, PROT_RW = 0, 3
MAP_PRIVATE, MAP_ANON, MAP_NORESERVE = 0x02, 0x20, 0x4000
POPULATE_WRITE, DONTNEED = 23, 4
TILE, ROWS, ROW_TILES, TENSORS, GROW = 12288, 32, 128, 60, 20
def vmas():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)
for prot in ("rw", "none"):
    base_vmas = vmas()
    bufs = []
    for _ in range(TENSORS):
        p = libc.mmap(None, ROWS * ROW_TILES * TILE, PROT_RW if prot == "rw" else PROT_NONE,
                      MAP_PRIVATE | MAP_ANON | MAP_NORESERVE, -1, 0)
        bufs.append(p)
    t = time.perf_counter(); calls = 0
    for tile in range(GROW):  # every row grows a tile in every tensor, as a decode batch does
        for b in bufs:
            for r in range(ROWS):
                a = b + (r * ROW_TILES + tile) * TILE
                if prot == "none":
                    assert libc.mprotect(a, TILE, PROT_RW) == 0
                assert libc.madvise(a, TILE, POPULATE_WRITE) == 0
                calls += 1
    dt = time.perf_counter() - t
    print(prot, f"{1e6 * dt / calls:.2f} us a tile commit, VMAs added {vmas() - base_vmas} "
          f"for {TENSORS} reservations x {ROWS} rows", flush=True)
    for b in bufs:
        libc.munmap(b, ROWS * ROW_TILES * TILE)
