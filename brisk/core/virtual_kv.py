"""The virtual KV layout's manager (vAttention, Prabhu et al. 2024): one contiguous row per request.

The runtime reserves, per layer, address space for `num_rows` rows of `row_tiles` tiles each
(runtime/virtual_kv.py) and backs it with physical pages only as tokens arrive. This manager
decides which row a request owns and how many of its tiles are committed; a tile is
`block_size` tokens of one layer's keys (or values), a whole number of pages:

    row 0   [ t0 | t1 | t2 | t3 | .. |          ...          ]   committed: 3 tiles (+1 ahead)
    row 1   [ t0 | .. reserved, no physical memory ........... ]
            block ids of row r = r * row_tiles + tile  (consecutive: the row IS the request's KV)

Capacity is committed tiles against a budget (`kv_cache_memory_gib` / bytes of one tile in
every layer), not blocks of a pool: a request's table is the first tiles of its row, so the
scheduler, the kernels and the decode plan read it exactly as a paged block table.

Commit ahead: when a request's tokens reach the last committed tile, the next one is committed
too (`ahead`), beside the forward that writes the current one, so a step in the steady state
never waits on a page fault. Deferred reclamation: a finished request's row keeps its pages and
goes to the top of the free rows, so the next request reuses them without faulting; warm rows
are given back when the budget runs short or the engine goes idle (`reclaim`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from brisk.core.kv_cache_manager import cdiv
from brisk.core.kv_manager import MemoryOp
from brisk.request import Request


class VirtualKVManager:
    """Rows and committed tiles of the virtual layout (core/kv_manager.py's protocol)."""

    enable_prefix_caching = False  # sharing a prefix's pages between rows is not built

    def __init__(self, num_rows: int, row_tiles: int, tile: int, budget_tiles: int,
                 commit_ahead: bool = True, deferred_reclaim: bool = True) -> None:
        if num_rows < 1 or row_tiles < 1 or tile < 1:
            raise ValueError(f"a virtual KV layout needs rows, tiles and tokens per tile >= 1, got "
                             f"{num_rows}, {row_tiles}, {tile}")
        if budget_tiles < 1:
            raise ValueError("the KV memory budget holds no tile of the virtual layout; raise kv_cache_memory_gib")
        self.block_size = tile
        self.num_rows = num_rows
        self.row_tiles = row_tiles
        self.budget = budget_tiles
        self.commit_ahead = commit_ahead
        self.deferred_reclaim = deferred_reclaim
        self._committed = [0] * num_rows  # per row: leading tiles backed by physical pages
        self._free_rows = list(reversed(range(num_rows)))  # a stack: the warmest row on top
        self._row_of: dict[str, int] = {}  # running request -> its row
        self._tiles_of: dict[str, int] = {}  # running request -> tiles its table covers
        self._ops: list[MemoryOp] = []
        self.num_committed = 0  # tiles committed over all rows (warm free rows included)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ----------------------------------------------------------------------------- capacity

    def fits_alone(self, num_tokens: int, chunk: int) -> bool:
        return cdiv(num_tokens, self.block_size) <= min(self.budget, self.row_tiles)

    def capacity_error(self, num_tokens: int, chunk: int) -> str:
        need = cdiv(num_tokens, self.block_size)
        if need > self.row_tiles:
            return (f"prompt has {num_tokens} tokens but a row of the virtual KV layout holds "
                    f"{self.row_tiles * self.block_size}; shorten the prompt or raise max_model_len")
        return (f"prompt has {num_tokens} tokens and needs {need} KV tiles of {self.block_size} tokens, but the "
                f"KV memory budget holds only {self.budget}; shorten the prompt or give the cache more memory")

    # ----------------------------------------------------------------------------- prefix cache

    def get_computed_blocks(self, request: Request) -> tuple[list[list[int]], int]:
        return [[]], 0

    def uncache(self, block_ids: Iterable[int]) -> None:
        pass  # nothing is cached

    # ----------------------------------------------------------------------------- allocation

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[Sequence[int]] = ()) -> list[list[int]] | None:
        """The request's table covering its computed tokens plus `num_new_tokens`, committing
        the tiles that takes (and one ahead); None, changing nothing, when the budget is short
        even after warm free rows are given back."""
        assert not any(new_computed_blocks), "the virtual layout has no prefix cache"
        rid = request.request_id
        need = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        assert need <= self.row_tiles, f"request {rid!r} outgrows its row: the scheduler bounds sequences"
        row = self._row_of.get(rid)
        new_row = row is None
        if new_row:
            if not self._free_rows:
                return None
            row = self._free_rows.pop()
        extra = max(0, need - self._committed[row])
        if not self._make_room(extra, keep=row):
            if new_row:
                self._free_rows.append(row)
            return None
        if new_row:
            self._row_of[rid] = row
        self._commit(row, extra, ahead=False)
        if self.commit_ahead and self._committed[row] == need < self.row_tiles and self.num_committed < self.budget:
            self._commit(row, 1, ahead=True)
        self._tiles_of[rid] = max(need, self._tiles_of.get(rid, 0))
        return [self._table(row, self._tiles_of[rid])]

    def _commit(self, row: int, count: int, ahead: bool) -> None:
        if count:
            self._ops.append(MemoryOp("populate", row, self._committed[row], count, ahead))
            self._committed[row] += count
            self.num_committed += count

    def _release(self, row: int) -> None:
        if self._committed[row]:
            self._ops.append(MemoryOp("release", row, 0, self._committed[row]))
            self.num_committed -= self._committed[row]
            self._committed[row] = 0

    def _make_room(self, tiles: int, keep: int) -> bool:
        """Give back warm free rows (the coldest first) until `tiles` more fit the budget."""
        if self.num_committed + tiles <= self.budget:
            return True
        for row in list(self._free_rows):  # bottom of the stack first: the longest unused
            if row != keep and self._committed[row]:
                self._release(row)
                if self.num_committed + tiles <= self.budget:
                    return True
        return False

    def _table(self, row: int, tiles: int) -> list[int]:
        base = row * self.row_tiles
        return list(range(base, base + tiles))

    def free(self, request: Request) -> None:
        """The request's row goes back on top of the free rows; its pages stay (deferred
        reclamation) or are given back now."""
        row = self._row_of.pop(request.request_id, None)
        self._tiles_of.pop(request.request_id, None)
        if row is None:
            return
        if not self.deferred_reclaim:
            self._release(row)
        self._free_rows.append(row)

    def reclaim(self) -> None:
        """Give back every free row's pages (the engine is idle)."""
        for row in self._free_rows:
            self._release(row)

    def take_memory_ops(self) -> list[MemoryOp]:
        ops, self._ops = self._ops, []
        return ops

    # ----------------------------------------------------------------------------- queries

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        row = self._row_of.get(request_id)
        return [[]] if row is None else [self._table(row, self._tiles_of[request_id])]

    def row_of(self, request_id: str) -> int | None:
        return self._row_of.get(request_id)

    @property
    def num_blocks(self) -> int:
        return self.budget

    @property
    def num_free_blocks(self) -> int:
        return self.budget - self.num_committed

    @property
    def usage(self) -> float:
        """Committed memory over the budget."""
        return self.num_committed / self.budget

    @property
    def num_used_tiles(self) -> int:
        """Tiles the running requests' tables cover (committed ones beyond: ahead or warm)."""
        return sum(self._tiles_of.values())

    @property
    def hit_rate(self) -> float:
        return 0.0

    def check_invariants(self, running_request_ids: Iterable[str]) -> None:
        running = set(running_request_ids)
        assert set(self._row_of) == running == set(self._tiles_of), (
            f"row holders {sorted(self._row_of)} != running {sorted(running)}")
        rows = list(self._row_of.values())
        assert len(set(rows)) == len(rows), "two requests share a row"
        assert sorted(rows + self._free_rows) == list(range(self.num_rows)), "a row is lost or listed twice"
        assert sum(self._committed) == self.num_committed <= self.budget
        for rid, row in self._row_of.items():
            assert self._tiles_of[rid] <= self._committed[row] <= self.row_tiles, (
                f"request {rid!r}: table of {self._tiles_of[rid]} tiles over {self._committed[row]} committed")
