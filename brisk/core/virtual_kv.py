"""The virtual KV layout's manager (vAttention, Prabhu et al. 2024): one contiguous row per request.

The runtime reserves, per layer, address space for `num_rows` rows of `row_tiles` tiles each
(runtime/virtual_kv.py) and backs it with physical pages only as tokens arrive. This manager
decides which row a request owns and which tiles are committed; a tile is `block_size` tokens of
one layer's keys (or values), a whole number of pages, and tile i of a row always holds
positions [i * block_size, (i + 1) * block_size) of the sequence that wrote it:

    row 0   [ t0 | t1 | t2 | t3 | .. |          ...          ]   committed: 3 tiles (+1 ahead)
    row 1   [ t0 | .. reserved, no physical memory ........... ]
            tile id = row * row_tiles + i: the request's block table, consecutive ids

Capacity is committed tiles against a budget (`kv_cache_memory_gib` / bytes of one tile in
every layer), not blocks of a pool; where a page holds many tiles (CUDA's 2 MiB) it is the pages
those tiles occupy (`PageModel`). The scheduler, the kernels and the decode plan read a table
exactly as a paged block table.

Prefix caching without remapping pages: a full tile that a request computed is published under
its chained hash (core/kv_cache_manager.hash_block). A later request whose tokens start the same
way reads those tiles where they are, in the row that computed them (its table names them: the
kernels read through tables, so no page is mapped twice), and writes its own tiles from the hit's
end on, in its own row at their own positions. The usual chat case, a conversation's next turn,
takes the row that holds its history, so its table is one run again. A shared tile is committed
once, however many tables name it.

    request B hits A's first two tiles:   B's table [ A.t0 A.t1 | B.t2 B.t3 ... ]   (B.t0, B.t1 unused)

Rules that keep rows honest: a row is handed only to a request that writes nowhere another
table reads (no tile from its hit's end on is named by a running request), and the tiles it
will write are withdrawn from the cache when it takes the row.

Commit ahead (`commit_ahead`, where the runtime has a spare core for it): when a request's tokens
reach its last committed tile, the next one is committed too (`ahead`), beside the forward that
writes the current one, so a step in the steady state never waits on a page fault. Without a
spare core the tiles a step writes are committed just in time, on the step's thread before its
forward (the forward still takes no fault), and nothing past them is held. Deferred reclamation:
a finished request's row keeps its pages and goes to the top of the free rows, so the next
request reuses them without faulting; pages no table names are given back when the budget runs
short (uncached ones first; where a page holds many tiles, whole pages only, so no cached tile
goes for a page that stays mapped), and uncached ones when the engine goes idle (`reclaim`; cached
tiles are the prefix cache and stay).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from brisk.core.block_pool import BlockHash
from brisk.core.kv_cache_manager import cdiv, extend_block_hashes, request_tokens
from brisk.core.kv_manager import MemoryOp
from brisk.errors import UserError
from brisk.request import Request


def run_pages(first: int, count: int, tile_bytes: int, page: int) -> list[tuple[int, int]]:
    """(page, how many of tiles [first, first + count) touch it) for every page those tiles of a
    tensor touch (tile t's bytes start at t x tile_bytes): what the runtime maps for them
    (DevicePages) and what `PageModel` counts."""
    start, end = first * tile_bytes, (first + count) * tile_bytes
    out = []
    for p in range(start // page, (end - 1) // page + 1):
        lo, hi = max(start, p * page), min(end, (p + 1) * page)
        out.append((p, (hi - 1) // tile_bytes - lo // tile_bytes + 1))
    return out


class PageModel:
    """The pages committed tiles occupy where a page holds many tiles (CUDA's 2 MiB pages; the
    runtime's DevicePages maps the same ones): per tile size, the committed tiles touching each
    page, so the manager counts memory as the device does, at admission, not tiles.

    `tensors`: tile bytes -> how many layer tensors have tiles of that size; a tile id's bytes sit
    at id x tile bytes in each (rows are whole pages, runtime/virtual_kv.VirtualKV.row_tiles_for)."""

    def __init__(self, page: int, tensors: dict[int, int]) -> None:
        self.page = page
        self.tensors = dict(tensors)
        self.bytes_per_tile = sum(size * n for size, n in tensors.items())
        self._count: dict[int, dict[int, int]] = {size: {} for size in tensors}  # size -> page -> tiles
        self.bytes = 0  # committed: pages x page bytes over every tensor

    def cost(self, tiles: Iterable[int]) -> int:
        """Bytes committing `tiles` (none of them committed yet) would add."""
        total = 0
        for size, n in self.tensors.items():
            count = self._count[size]
            fresh = {p for t in tiles for p, _ in run_pages(t, 1, size, self.page) if not count.get(p)}
            total += len(fresh) * n * self.page
        return total

    def alone(self, num_tiles: int) -> int:
        """Bytes a row's first `num_tiles` tiles take with nothing else committed (rows start on a page)."""
        return sum(n * -(-num_tiles * size // self.page) * self.page for size, n in self.tensors.items())

    def add(self, tiles: Iterable[int]) -> None:
        for size, n in self.tensors.items():
            count = self._count[size]
            for t in tiles:
                for p, _ in run_pages(t, 1, size, self.page):
                    if not count.get(p):
                        self.bytes += n * self.page
                    count[p] = count.get(p, 0) + 1

    def freed(self, tiles: Iterable[int], keep: Iterable[int] = ()) -> int:
        """Bytes giving back `tiles` (all committed) would return: the pages no other tile holds,
        nor any of `keep` (tiles about to be committed, which would map them again)."""
        tiles, keep = list(tiles), list(keep)
        total = 0
        for size, n in self.tensors.items():
            count, on = self._count[size], {}
            for t in tiles:
                for p, _ in run_pages(t, 1, size, self.page):
                    on[p] = on.get(p, 0) + 1
            kept = {p for t in keep for p, _ in run_pages(t, 1, size, self.page)}
            total += sum(n * self.page for p, k in on.items() if count.get(p) == k and p not in kept)
        return total

    def cuts(self, row_tiles: int) -> list[int]:
        """Tile indices of a row where a new page starts in every tensor (rows start on pages):
        the tiles between two cuts share pages, so they are given back together or not at all."""
        return [i for i in range(row_tiles) if all(i * size % self.page == 0 for size in self.tensors)]

    def remove(self, tiles: Iterable[int]) -> None:
        for size, n in self.tensors.items():
            count = self._count[size]
            for t in tiles:
                for p, _ in run_pages(t, 1, size, self.page):
                    count[p] -= 1
                    if not count[p]:
                        del count[p]
                        self.bytes -= n * self.page


class VirtualKVManager:
    """Rows, committed tiles and the prefix cache of the virtual layout (core/kv_manager.py's protocol)."""

    def __init__(self, num_rows: int, row_tiles: int, tile: int, budget_tiles: int,
                 enable_prefix_caching: bool = False, commit_ahead: bool = True,
                 deferred_reclaim: bool = True, pages: PageModel | None = None) -> None:
        """`pages`: where a page holds many tiles, the capacity is counted in their pages (the
        budget is then `budget_tiles` x the model's bytes per tile, in pages); None: tiles are
        whole pages and are counted themselves."""
        if num_rows < 1 or row_tiles < 1 or tile < 1:
            raise UserError(f"a virtual KV layout needs rows, tiles and tokens per tile >= 1, got "
                             f"{num_rows}, {row_tiles}, {tile}")
        if budget_tiles < 1:
            raise UserError("the KV memory budget holds no tile of the virtual layout; raise kv_cache_memory_gib")
        self.block_size = tile
        self.num_rows = num_rows
        self.row_tiles = row_tiles
        self.budget = budget_tiles
        self.enable_prefix_caching = enable_prefix_caching
        self.commit_ahead = commit_ahead
        self.deferred_reclaim = deferred_reclaim
        n = num_rows * row_tiles
        self._populated = bytearray(n)  # per tile: backed by physical pages
        self._refs = [0] * n  # per tile: tables of running requests naming it
        self._free_rows = list(reversed(range(num_rows)))  # a stack: the warmest row on top
        self._row_of: dict[str, int] = {}  # running request -> its row
        self._table: dict[str, list[int]] = {}  # running request -> its tiles (a hit's, then its own)
        self._own_start: dict[str, int] = {}  # running request -> first position index it writes
        self._hashes: dict[str, list[BlockHash]] = {}  # running request -> hashes of its full tiles
        self._num_published: dict[str, int] = {}  # running request -> leading tiles in the cache
        self._cached: dict[BlockHash, int] = {}  # hash -> the tile holding those tokens
        self._key_of: dict[int, tuple[BlockHash, tuple[int, ...]]] = {}  # cached tile -> (hash, tokens)
        self._ops: list[MemoryOp] = []
        self.num_committed = 0  # populated tiles over all rows
        self.pages = pages
        # tiles of a row given back together: each alone, or those sharing pages
        cuts = list(range(row_tiles)) if pages is None else pages.cuts(row_tiles)
        self._groups = [range(a, b) for a, b in zip(cuts, cuts[1:] + [row_tiles])]
        self.prefix_cache_queries = 0  # tokens looked up, once per admission
        self.prefix_cache_hits = 0

    # ----------------------------------------------------------------------------- capacity

    def _used(self) -> int:
        """Committed memory in tiles' worth: the tiles, or the pages they occupy."""
        if self.pages is None:
            return self.num_committed
        return -(-self.pages.bytes // self.pages.bytes_per_tile)

    def _fits(self, tiles: list[int]) -> bool:
        """Whether committing `tiles` (none committed yet) keeps memory within the budget."""
        return self._excess(tiles) <= 0

    def _excess(self, tiles: list[int]) -> int:
        """What committing `tiles` would take beyond the budget (<= 0: they fit): tiles, or bytes
        where pages are counted (rounding the committed and the new part each up to tiles' worth
        could refuse a lone request what fits_alone promised)."""
        if self.pages is None:
            return self.num_committed + len(tiles) - self.budget
        return self.pages.bytes + self.pages.cost(tiles) - self.budget * self.pages.bytes_per_tile

    def _freed(self, tiles: list[int], coming: list[int]) -> int:
        """What giving back `tiles` returns while `coming` tiles are committed, in `_excess`'s unit."""
        return len(tiles) if self.pages is None else self.pages.freed(tiles, keep=coming)

    def fits_alone(self, num_tokens: int, chunk: int) -> bool:
        need = cdiv(num_tokens, self.block_size)
        if self.pages is not None:  # the pages its tiles occupy
            return need <= self.row_tiles and self.pages.alone(need) <= self.budget * self.pages.bytes_per_tile
        return need <= min(self.budget, self.row_tiles)

    def capacity_error(self, num_tokens: int, chunk: int) -> str:
        need = cdiv(num_tokens, self.block_size)
        if need > self.row_tiles:
            return (f"prompt has {num_tokens} tokens but a row of the virtual KV layout holds "
                    f"{self.row_tiles * self.block_size}; shorten the prompt or raise max_model_len")
        pages = "" if self.pages is None else \
            f" ({-(-self.pages.alone(need) // self.pages.bytes_per_tile)} with the pages they occupy)"
        return (f"prompt has {num_tokens} tokens and needs {need} KV tiles of {self.block_size} tokens{pages}, but "
                f"the KV memory budget holds only {self.budget}; shorten the prompt or give the cache more memory")

    # ----------------------------------------------------------------------------- prefix cache

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        return extend_block_hashes(self._hashes.setdefault(request.request_id, []), request, self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[list[int]], int]:
        """The longest run of cached full tiles the request's tokens start with (at least one
        token is left to compute): ([tiles], tokens they hold)."""
        if not self.enable_prefix_caching:
            return [[]], 0
        bs = self.block_size
        hashes = self._block_hashes(request)
        hit: list[int] = []
        for i in range(min(len(hashes), (request.num_tokens - 1) // bs)):
            tile = self._cached.get(hashes[i])
            if tile is None or self._key_of[tile][1] != tuple(request_tokens(request, i * bs, (i + 1) * bs)):
                break
            hit.append(tile)
        return [hit], len(hit) * bs

    def uncache(self, block_ids: Iterable[int]) -> None:
        """Withdraw tiles a failed step was to fill: they hold no valid KV."""
        for tile in block_ids:
            self._forget(tile)

    def reset_prefix_cache(self) -> None:
        for tile in list(self._key_of):
            self._forget(tile)

    def _forget(self, tile: int) -> None:
        key = self._key_of.pop(tile, None)
        if key is not None:
            del self._cached[key[0]]

    # ----------------------------------------------------------------------------- allocation

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[Sequence[int]] = ()) -> list[list[int]] | None:
        """The request's table covering its computed tokens (and hit) plus `num_new_tokens`,
        committing the tiles that takes (and one ahead); None, changing nothing that matters,
        when no row can take it or the budget is short even after giving back unnamed pages."""
        rid = request.request_id
        hit = list(new_computed_blocks[0]) if new_computed_blocks else []
        first = request.num_computed_tokens + len(hit) * self.block_size
        need = cdiv(first + num_new_tokens, self.block_size)
        assert need <= self.row_tiles, f"request {rid!r} outgrows its row: the scheduler bounds sequences"
        if rid not in self._row_of:
            if not self._admit(request, hit, need):
                return None
        else:
            assert not hit, "hits only at admission"
            table = self._table[rid]
            row = self._row_of[rid]
            grow = [row * self.row_tiles + i for i in range(len(table), need)]
            if not self._take(grow):
                return None
            table.extend(grow)
        self._commit_ahead(rid, need)
        self._publish(request, first + num_new_tokens)
        return [list(self._table[rid])]

    def _admit(self, request: Request, hit: list[int], need: int) -> bool:
        """A new request: a row, its table (the hit, then its own tiles), their pages."""
        rid, k = request.request_id, len(hit)
        row = self._pick_row(hit)
        if row is None:
            return False
        own = [row * self.row_tiles + i for i in range(k, max(k, need))]
        for tile in hit:
            self._refs[tile] += 1  # named before room is made: the hit's pages are not given back
        self._free_rows.remove(row)
        if not self._take(own, keep_row=row):
            for tile in hit:
                self._refs[tile] -= 1
                if self.pages is not None:
                    # a hit spread over other rows holds their pages, which its own tiles' pages may
                    # not fit beside even alone: withdrawn, the request computes the prefix itself
                    # next time and those pages can be given back (fits_alone counts no hit)
                    self._forget(tile)
            self._free_rows.append(row)
            return False
        for i in range(k, self.row_tiles):  # tiles this request will write: stale cache entries go
            self._forget(row * self.row_tiles + i)
        self._row_of[rid], self._table[rid], self._own_start[rid] = row, hit + own, k
        self._num_published[rid] = k
        if self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += k * self.block_size
        return True

    def _pick_row(self, hit: list[int]) -> int | None:
        """A free row that the request may write from the hit's end on: the row holding the hit
        at its own positions (one run, nothing borrowed), else the warmest row without cached
        tiles to lose, else any that can take it; None when none can."""
        k, rt = len(hit), self.row_tiles
        eligible = [r for r in reversed(self._free_rows)  # warmest first
                    if not any(self._refs[r * rt + i] for i in range(k, rt))]
        if not eligible:
            return None
        if hit and hit[-1] - hit[0] == k - 1 and hit[0] // rt in eligible:  # tiles sit at their positions
            return hit[0] // rt
        clean = [r for r in eligible if not any(r * rt + i in self._key_of for i in range(k, rt))]
        return (clean or eligible)[0]

    def _take(self, tiles: list[int], keep_row: int | None = None) -> bool:
        """Name `tiles` in a table and commit the unpopulated ones, making room if needed (named
        first, so making room never gives back their pages)."""
        for tile in tiles:
            self._refs[tile] += 1
        missing = [t for t in tiles if not self._populated[t]]
        if not self._make_room(missing, keep_row):
            for tile in tiles:
                self._refs[tile] -= 1
            return False
        self._populate(missing, ahead=False)
        return True

    def _commit_ahead(self, rid: str, need: int) -> None:
        """One tile past the table, committed beside the forward, when the table reached the last one."""
        row = self._row_of[rid]
        nxt = row * self.row_tiles + need
        if (self.commit_ahead and 0 < need < self.row_tiles and not self._populated[nxt]
                and self._populated[nxt - 1] and self._fits([nxt])):
            self._forget(nxt)
            self._populate([nxt], ahead=True)

    def _populate(self, tiles: list[int], ahead: bool) -> None:
        for tile in tiles:
            self._populated[tile] = 1
        self.num_committed += len(tiles)
        if self.pages is not None:
            self.pages.add(tiles)
        self._ops.extend(MemoryOp("populate", r, f, n, ahead) for r, f, n in self._runs(tiles))

    def _release(self, tiles: list[int]) -> None:
        for tile in tiles:
            assert self._refs[tile] == 0 and self._populated[tile]
            self._populated[tile] = 0
            self._forget(tile)
        self.num_committed -= len(tiles)
        if self.pages is not None:
            self.pages.remove(tiles)
        self._ops.extend(MemoryOp("release", r, f, n) for r, f, n in self._runs(tiles))

    def _runs(self, tiles: list[int]) -> list[tuple[int, int, int]]:
        """Sorted tiles as (row, first, count) runs within rows."""
        runs: list[tuple[int, int, int]] = []
        for tile in sorted(tiles):
            row, i = divmod(tile, self.row_tiles)
            if runs and runs[-1][0] == row and runs[-1][1] + runs[-1][2] == i:
                runs[-1] = (row, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((row, i, 1))
        return runs

    def _unnamed(self, row: int, cached: bool) -> list[int]:
        """The row's populated tiles no table names, cached or not."""
        base = row * self.row_tiles
        return [t for t in range(base, base + self.row_tiles)
                if self._populated[t] and not self._refs[t] and (t in self._key_of) == cached]

    def _make_room(self, tiles: list[int], keep_row: int | None) -> bool:
        """Give back pages no table names until `tiles` (uncommitted) fit: uncached ones first,
        the coldest free rows first, then running rows' (tiles ahead, stale ones); then cached
        ones (the least recently freed rows' first). `keep_row`'s pages go last. Where pages
        hold many tiles, tiles go only where that frees pages: a run of tiles whose pages all hold
        a named one (or, in the first pass, a cached one, or one of `tiles`, which would map them
        again) stays, since giving it back frees nothing."""
        excess = self._excess(tiles)
        if excess <= 0:
            return True
        running = [r for r in self._row_of.values() if r != keep_row]
        order = [r for r in self._free_rows if r != keep_row] + running
        order += [keep_row] if keep_row is not None else []
        for cached in (False, True):
            for row in order:
                gone: list[int] = []
                # the row's last tiles first: a cached chain keeps its head
                for run in reversed(self._spare(row, cached)):
                    freed = self._freed(run, tiles)
                    if freed <= 0:  # its pages hold named (or cached, or about to be committed) tiles too
                        continue
                    excess -= freed
                    gone += run
                    if excess <= 0:
                        break
                if gone:
                    self._release(gone)
                    excess = self._excess(tiles)
                if excess <= 0:
                    return True
        return False

    def _spare(self, row: int, cached: bool) -> list[list[int]]:
        """The row's committed tiles that nothing named holds (nor, unless `cached`, the prefix
        cache), in runs within the groups of tiles sharing pages, in row order."""
        base, out = row * self.row_tiles, []
        for group in self._groups:
            run: list[int] = []
            for tile in (base + i for i in group if self._populated[base + i]):
                if self._refs[tile] or (not cached and tile in self._key_of):
                    if run:
                        out.append(run)
                    run = []
                else:
                    run.append(tile)
            if run:
                out.append(run)
        return out

    def _publish(self, request: Request, num_tokens_after: int) -> None:
        """Cache the request's own tiles that are full once this step's tokens are computed."""
        if not self.enable_prefix_caching:
            return
        rid, bs = request.request_id, self.block_size
        start = self._num_published[rid]
        num_full = min(num_tokens_after, request.num_tokens) // bs
        if num_full <= start:
            return
        hashes, table = self._block_hashes(request), self._table[rid]
        for i in range(start, num_full):
            if hashes[i] not in self._cached:  # a twin computed elsewhere stays the cached copy
                self._cached[hashes[i]] = table[i]
                self._key_of[table[i]] = (hashes[i], tuple(request_tokens(request, i * bs, (i + 1) * bs)))
        self._num_published[rid] = num_full

    def free(self, request: Request) -> None:
        """The request's tables let go of its tiles; its row goes back on top of the free rows.
        Its pages stay (deferred reclamation; cached tiles are the prefix cache) or, without
        deferred reclamation, its unnamed uncached ones are given back now."""
        rid = request.request_id
        self._hashes.pop(rid, None)  # a waiting request's lookup made some too
        row = self._row_of.pop(rid, None)
        if row is None:
            return
        for tile in self._table.pop(rid):
            self._refs[tile] -= 1
        self._own_start.pop(rid)
        self._num_published.pop(rid)
        if not self.deferred_reclaim:
            self._release(self._unnamed(row, cached=False))
        self._free_rows.append(row)

    def uncommit(self, tiles: Iterable[int]) -> None:
        """Tiles whose pages could not be committed (the runtime's commit failed): counted as
        committed no more, nor cached; the requests naming them end (`requests_naming`)."""
        for tile in tiles:
            if self._populated[tile]:
                self._populated[tile] = 0
                self.num_committed -= 1
                self._forget(tile)
                if self.pages is not None:
                    self.pages.remove([tile])

    def requests_naming(self, tiles: Iterable[int]) -> list[str]:
        """Running requests whose tables name any of `tiles`."""
        wanted = set(tiles)
        return [rid for rid, table in self._table.items() if not wanted.isdisjoint(table)]

    def reclaim(self) -> None:
        """Give back every page no table names and no cache entry holds (the engine is idle)."""
        for row in range(self.num_rows):
            gone = self._unnamed(row, cached=False)
            if gone:
                self._release(gone)

    def take_memory_ops(self) -> list[MemoryOp]:
        ops, self._ops = self._ops, []
        return ops

    # ----------------------------------------------------------------------------- queries

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        table = self._table.get(request_id)
        return [[]] if table is None else [list(table)]

    def row_of(self, request_id: str) -> int | None:
        return self._row_of.get(request_id)

    @property
    def num_blocks(self) -> int:
        return self.budget

    @property
    def num_free_blocks(self) -> int:
        return max(0, self.budget - self._used())

    @property
    def num_cached_tiles(self) -> int:
        return len(self._key_of)

    @property
    def usage(self) -> float:
        """Committed memory over the budget."""
        return self._used() / self.budget

    @property
    def num_used_tiles(self) -> int:
        """Distinct tiles the running requests' tables name."""
        return len({t for table in self._table.values() for t in table})

    @property
    def hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def check_invariants(self, running_request_ids: Iterable[str]) -> None:
        running = set(running_request_ids)
        assert set(self._row_of) == running == set(self._table), (
            f"row holders {sorted(self._row_of)} != running {sorted(running)}")
        rows = list(self._row_of.values())
        assert len(set(rows)) == len(rows), "two requests share a row"
        assert sorted(rows + self._free_rows) == list(range(self.num_rows)), "a row is lost or listed twice"
        assert sum(self._populated) == self.num_committed and self._used() <= self.budget
        if self.pages is not None:  # the running count is what the committed tiles occupy
            again = PageModel(self.pages.page, self.pages.tensors)
            again.add([t for t, on in enumerate(self._populated) if on])
            assert again.bytes == self.pages.bytes, "the page count drifted from the committed tiles"
        refs = [0] * len(self._refs)
        for rid, table in self._table.items():
            row, k = self._row_of[rid], self._own_start[rid]
            assert table[k:] == [row * self.row_tiles + i for i in range(k, len(table))], (
                f"request {rid!r}: its own tiles are not its row's at their positions")
            assert all(t % self.row_tiles == i for i, t in enumerate(table)), f"request {rid!r}: a tile off its position"
            for tile in table:
                refs[tile] += 1
                assert self._populated[tile], f"request {rid!r} names tile {tile}, which holds no pages"
        assert refs == self._refs, "tile reference counts drifted"
        for key, tile in self._cached.items():
            assert self._key_of[tile][0] == key and self._populated[tile]
        assert len(self._cached) == len(self._key_of)
