"""The virtual KV layout's manager: rows, committed tiles, commit ahead, deferred reclamation,
and the scheduler driving it through preemption (exact rows, tiles and memory ops)."""

from __future__ import annotations

import pytest

from brisk.config import SchedulerConfig
from brisk.core.kv_manager import MemoryOp
from brisk.core.scheduler import Scheduler
from brisk.core.virtual_kv import VirtualKVManager
from brisk.request import Request, SamplingParams

T = 4  # tokens per tile


def _req(rid: str, n: int, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=max_tokens), eos_token_ids=frozenset({0}))


def test_a_request_owns_one_row_and_its_table_is_consecutive_tiles() -> None:
    kv = VirtualKVManager(num_rows=3, row_tiles=8, tile=T, budget_tiles=20)
    a, b = _req("a", 10), _req("b", 3)
    assert kv.allocate_slots(a, 10) == [[0, 1, 2]]  # row 0: tiles 0..2
    assert kv.allocate_slots(b, 3) == [[8]]  # row 1 starts at tile 8
    assert kv.take_memory_ops() == [MemoryOp("populate", 0, 0, 3), MemoryOp("populate", 0, 3, 1, ahead=True),
                                    MemoryOp("populate", 1, 0, 1), MemoryOp("populate", 1, 1, 1, ahead=True)]
    assert kv.num_committed == 6 and kv.num_used_tiles == 4
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 2) == [[0, 1, 2]]  # 12 tokens: still three tiles, nothing new
    assert kv.take_memory_ops() == []
    a.num_computed_tokens = 12
    # the 13th token enters the tile committed ahead; the next one is committed ahead in turn
    assert kv.allocate_slots(a, 1) == [[0, 1, 2, 3]]
    assert kv.take_memory_ops() == [MemoryOp("populate", 0, 4, 1, ahead=True)]
    kv.check_invariants(["a", "b"])


def test_deferred_reclamation_reuses_the_warm_row_and_gives_it_back_when_short() -> None:
    kv = VirtualKVManager(num_rows=3, row_tiles=8, tile=T, budget_tiles=8)
    a = _req("a", 12)
    kv.allocate_slots(a, 12)
    kv.take_memory_ops()
    kv.free(a)  # row 0 keeps its 4 tiles (3 + 1 ahead): warm
    assert kv.num_committed == 4 and kv.take_memory_ops() == []
    b = _req("b", 5)
    assert kv.allocate_slots(b, 5) == [[0, 1]]  # the warm row again: its pages are there already
    assert kv.take_memory_ops() == []
    c = _req("c", 4)
    assert kv.allocate_slots(c, 4) == [[8]]  # row 1: one tile and one ahead
    kv.take_memory_ops()
    kv.free(c)
    kv.free(b)  # free rows, warmest on top: 2 (cold), 1 (2 tiles), 0 (4 tiles)
    d = _req("d", 20)
    # d takes row 0 (4 tiles) and needs 5: one more, one ahead; row 1 stays warm (8 committed)
    assert kv.allocate_slots(d, 20) == [[0, 1, 2, 3, 4]]
    assert kv.take_memory_ops() == [MemoryOp("populate", 0, 4, 1), MemoryOp("populate", 0, 5, 1, ahead=True)]
    e = _req("e", 8)
    # e takes row 1 (2 tiles, enough) ...
    assert kv.allocate_slots(e, 8) == [[8, 9]] and kv.take_memory_ops() == []
    kv.free(e)
    f = _req("f", 12)
    # ... f takes row 1 again and needs one tile more: the budget is full (d's 6 + row 1's 2); no
    # free row holds pages no table names, but d's tile ahead is one: it is given back
    assert kv.allocate_slots(f, 12) == [[8, 9, 10]]
    assert kv.take_memory_ops() == [MemoryOp("release", 0, 5, 1), MemoryOp("populate", 1, 2, 1)]
    g = _req("g", 8)
    # g takes row 2 (cold) and needs two tiles: every committed tile is named by d or f: short
    assert kv.allocate_slots(g, 8) is None and kv.take_memory_ops() == []
    kv.free(f)  # row 1 (3 tiles) on top again: g takes it, nothing to commit
    assert kv.allocate_slots(g, 8) == [[8, 9]] and kv.take_memory_ops() == []
    kv.check_invariants(["d", "g"])
    kv.free(d)
    kv.free(g)
    kv.reclaim()  # idle: every page back
    assert kv.num_committed == 0
    assert sorted(op.row for op in kv.take_memory_ops()) == [0, 1]
    kv.check_invariants([])


def test_a_warm_row_gives_its_pages_back_to_another_row_short_of_budget() -> None:
    kv = VirtualKVManager(num_rows=2, row_tiles=8, tile=T, budget_tiles=6, commit_ahead=False)
    a, b = _req("a", 16), _req("b", 4)
    kv.allocate_slots(a, 16)  # row 0: 4 tiles
    assert kv.allocate_slots(b, 4) == [[8]]  # row 1: 1 tile
    kv.free(a)  # row 0 warm (4 tiles) on top
    b.num_computed_tokens = 4
    kv.take_memory_ops()
    # b needs 3 tiles more: 5 + 3 > 6, so warm row 0 gives two back, its last ones
    assert kv.allocate_slots(b, 12) == [[8, 9, 10, 11]]
    assert kv.take_memory_ops() == [MemoryOp("release", 0, 2, 2), MemoryOp("populate", 1, 1, 3)]
    kv.check_invariants(["b"])


def test_eager_reclamation_gives_pages_back_at_once() -> None:
    kv = VirtualKVManager(num_rows=2, row_tiles=8, tile=T, budget_tiles=8, commit_ahead=False, deferred_reclaim=False)
    a = _req("a", 6)
    kv.allocate_slots(a, 6)
    kv.free(a)
    assert kv.take_memory_ops() == [MemoryOp("populate", 0, 0, 2), MemoryOp("release", 0, 0, 2)]
    assert kv.num_committed == 0


def test_capacity_answers_in_rows_and_budget() -> None:
    kv = VirtualKVManager(num_rows=2, row_tiles=8, tile=T, budget_tiles=5)
    assert kv.fits_alone(20, 512) and not kv.fits_alone(21, 512)  # the budget: 5 tiles
    assert "budget holds only 5" in kv.capacity_error(21, 512)
    wide = VirtualKVManager(num_rows=2, row_tiles=4, tile=T, budget_tiles=100)
    assert not wide.fits_alone(17, 512) and "a row of the virtual KV layout holds 16" in wide.capacity_error(17, 512)
    with pytest.raises(ValueError, match="raise kv_cache_memory_gib"):
        VirtualKVManager(2, 4, T, 0)


def test_the_scheduler_preempts_and_every_row_and_tile_comes_back() -> None:
    """Three long requests on a budget for about two: the newest is preempted (its row given
    back to the warm stack), all finish, and once reclaimed nothing is committed."""
    kv = VirtualKVManager(num_rows=3, row_tiles=16, tile=T, budget_tiles=12)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=3, max_model_len=64), kv)
    for rid in "abc":
        sched.add_request(_req(rid, 16, max_tokens=12))
    finished: set[str] = set()
    for _ in range(200):
        out = sched.schedule()
        if out.is_empty:
            break
        for item in out.scheduled:  # a table is the row's first tiles, covering the step's tokens
            row = kv.row_of(item.request_id)
            assert row is not None
            table = item.block_ids[0]
            assert table == list(range(row * 16, row * 16 + len(table)))
            assert len(table) * T >= item.start_pos + item.num_tokens
        sampled = {s.request_id: [7] for s in out.scheduled if s.sample}
        finished |= {r.request_id for r in sched.update_from_output(out, sampled) if r.is_finished()}
        sched.check_invariants()
    assert finished == {"a", "b", "c"} and sched.num_preemptions > 0
    kv.reclaim()
    assert kv.num_committed == 0
    kv.check_invariants([])


def _computed(r: Request, n: int) -> None:
    r.num_computed_tokens = n


def test_a_conversations_next_turn_takes_the_row_holding_its_history() -> None:
    kv = VirtualKVManager(num_rows=3, row_tiles=8, tile=T, budget_tiles=20, enable_prefix_caching=True)
    a = _req("a", 13)
    kv.allocate_slots(a, 13)  # tiles 0..3 of row 0: three full ones are cached
    kv.free(a)
    turn = Request("b", list(range(100, 113)) + [5, 6, 7], SamplingParams(max_tokens=8), eos_token_ids=frozenset({0}))
    hit, tokens = kv.get_computed_blocks(turn)
    assert hit == [[0, 1, 2]] and tokens == 12
    assert kv.allocate_slots(turn, 4, hit) == [[0, 1, 2, 3]]  # row 0 again: one run, nothing borrowed
    assert kv.row_of("b") == 0 and kv.hit_rate == 12 / (13 + 16)
    kv.check_invariants(["b"])


def test_concurrent_requests_share_a_prefix_in_place_and_it_is_committed_once() -> None:
    kv = VirtualKVManager(num_rows=3, row_tiles=8, tile=T, budget_tiles=20, enable_prefix_caching=True,
                          commit_ahead=False)
    system = list(range(100, 108))  # two full tiles
    a = Request("a", system + [1, 2, 3], SamplingParams(max_tokens=8), eos_token_ids=frozenset({0}))
    b = Request("b", system + [4, 5, 6, 7, 8], SamplingParams(max_tokens=8), eos_token_ids=frozenset({0}))
    assert kv.allocate_slots(a, 11) == [[0, 1, 2]]
    hit, tokens = kv.get_computed_blocks(b)
    assert hit == [[0, 1]] and tokens == 8
    # b reads a's two tiles where they are and writes its own from position 8 on, in row 1
    assert kv.allocate_slots(b, 5, hit) == [[0, 1, 10, 11]]
    assert kv.num_committed == 5 and kv.num_used_tiles == 5  # the shared tiles count once
    kv.check_invariants(["a", "b"])
    kv.free(a)
    # c shares nothing and would write row 0 from its start, where b still reads: it takes row 2
    c = _req("c", 3)
    c.prompt_token_ids = [9, 9, 9]
    assert kv.get_computed_blocks(c) == ([[]], 0)
    assert kv.allocate_slots(c, 3) == [[16]]
    kv.check_invariants(["b", "c"])
    kv.free(b)
    kv.free(c)
    kv.reclaim()  # uncached pages back; the cached tiles stay: they are the prefix cache
    cached = kv.num_cached_tiles
    assert kv.num_committed == cached == 3  # a's two system tiles and b's full tile 2
    kv.check_invariants([])


def test_reset_prefix_cache_forgets_every_cached_tile() -> None:
    kv = VirtualKVManager(num_rows=3, row_tiles=8, tile=T, budget_tiles=20, enable_prefix_caching=True)
    a = _req("a", 13)
    kv.allocate_slots(a, 13)
    kv.free(a)
    assert kv.num_cached_tiles == 3
    kv.reset_prefix_cache()
    turn = Request("b", list(range(100, 113)) + [5], SamplingParams(max_tokens=8), eos_token_ids=frozenset({0}))
    assert kv.num_cached_tiles == 0 and kv.get_computed_blocks(turn) == ([[]], 0)
    kv.check_invariants([])


def test_cached_tiles_are_given_back_last_and_leave_the_cache() -> None:
    kv = VirtualKVManager(num_rows=2, row_tiles=8, tile=T, budget_tiles=6, enable_prefix_caching=True,
                          commit_ahead=False)
    a = _req("a", 17)
    kv.allocate_slots(a, 17)  # 5 tiles of row 0, 4 of them full and cached
    kv.free(a)
    b = Request("b", [1] * 12, SamplingParams(max_tokens=8), eos_token_ids=frozenset({0}))
    assert kv.get_computed_blocks(b) == ([[]], 0)
    # b takes row 1 and needs 3 tiles: 5 + 3 > 6, so row 0 gives back its uncached last tile, then
    # a cached one, the chain's tail first
    assert kv.allocate_slots(b, 12) == [[8, 9, 10]]
    assert kv.take_memory_ops()[:3] == [MemoryOp("populate", 0, 0, 5), MemoryOp("release", 0, 4, 1),
                                        MemoryOp("release", 0, 3, 1)]
    assert kv.num_cached_tiles == 3 + 3  # a's first three, and b's own three full tiles
    replay = _req("again", 17)
    assert kv.get_computed_blocks(replay) == ([[0, 1, 2]], 12)
    kv.check_invariants(["b"])


def test_the_page_model_counts_the_pages_tiles_occupy() -> None:
    """Pages of 4 KiB over tiles of 3 KiB (two tensors) and 1 KiB (one): tiles straddling pages,
    pages shared by tiles, each tile size its own pages."""
    from brisk.core.virtual_kv import PageModel

    pages = PageModel(4096, {3072: 2, 1024: 1})
    assert pages.bytes_per_tile == 7168
    # tiles 0-1: bytes 0..6143 of the 3 KiB tensors (pages 0, 1), 0..2047 of the 1 KiB one (page 0)
    assert pages.cost([0, 1]) == 2 * 2 * 4096 + 4096
    pages.add([0, 1])
    assert pages.bytes == 5 * 4096
    assert pages.cost([2]) == 2 * 4096  # bytes 6144..9215: page 1 is there, page 2 is new; page 0 of the 1 KiB one too
    pages.add([2])
    # giving back tile 0 frees nothing (page 0 of each tensor holds tile 1 too); tiles 0-1 free
    # page 0 of the 3 KiB tensors only (tile 2 holds page 1 and page 0 of the 1 KiB one)
    assert pages.freed([0]) == 0 and pages.freed([0, 1]) == 2 * 4096
    assert pages.freed([0, 1, 2]) == pages.bytes
    # tile 2 alone frees page 2 of the 3 KiB tensors, unless tile 3, about to be committed, needs it
    assert pages.freed([2]) == 2 * 4096 and pages.freed([2], keep=[3]) == 0
    assert pages.cuts(12) == [0, 4, 8]  # where both tensors start a page: tiles 0-3 share pages
    pages.remove([0, 1])
    assert pages.bytes == 2 * 2 * 4096 + 4096  # tile 2 keeps pages 1 and 2 of the 3 KiB tensors, page 0 of the other
    pages.remove([2])
    assert pages.bytes == 0 and pages.cost([0]) == 2 * 4096 + 4096


def test_a_prompt_fits_alone_only_with_the_pages_its_tiles_occupy() -> None:
    from brisk.core.virtual_kv import PageModel, VirtualKVManager

    # 1 KiB tiles in 2 tensors (2 KiB a tile's worth), 8 KiB pages: a row's first tile takes 16 KiB = 8 tiles' worth
    manager = VirtualKVManager(4, 64, 16, 10, pages=PageModel(8192, {1024: 2}))
    assert manager.fits_alone(16 * 8, 512)  # 8 tiles: one page in each tensor, 8 tiles' worth
    assert not manager.fits_alone(16 * 9, 512)  # 9 tiles: a second page each, 16 tiles' worth > 10
    assert "(16 with the pages they occupy)" in manager.capacity_error(16 * 9, 512)
    assert VirtualKVManager(4, 64, 16, 10).fits_alone(16 * 9, 512)  # counting tiles, it would fit


def test_a_lone_request_grows_to_what_fits_alone_promised() -> None:
    """Pages of 1.25 tiles: the budget in bytes, not the committed and new parts each rounded up."""
    from brisk.core.virtual_kv import PageModel

    kv = VirtualKVManager(2, 8, T, 3, commit_ahead=False, pages=PageModel(5120, {4096: 1}))
    assert kv.fits_alone(2 * T, 64)
    a = _req("a", T)
    assert kv.allocate_slots(a, T) == [[0]]
    a.num_computed_tokens = T
    assert kv.allocate_slots(a, 1) == [[0, 1]]  # 8 KiB over 2 pages of 5 KiB: 10 KiB <= 12 KiB
    kv.check_invariants(["a"])


def test_a_prefix_hit_whose_pages_cannot_fit_is_withdrawn_so_the_request_runs() -> None:
    """Pages of 8 tiles, a budget of 16 tiles' worth (two pages), three rows: a hit spread over
    rows 0 and 1 holds both pages, and the request's own tiles need a third. Admission fails and
    withdraws the hit from the cache; next time the request computes the prefix itself and fits."""
    from brisk.core.virtual_kv import PageModel

    kv = VirtualKVManager(3, 16, T, 16, enable_prefix_caching=True, commit_ahead=False,
                          pages=PageModel(8 * 1024, {1024: 1}))
    x = Request("x", list(range(100, 100 + 8 * T)), SamplingParams(max_tokens=8), eos_token_ids=frozenset({0}))
    assert kv.allocate_slots(x, 8 * T) == [list(range(8))]
    x.num_computed_tokens = 8 * T  # x still runs: z writes its own tiles in another row
    z = Request("z", list(range(100, 100 + 2 * T)) + list(range(300, 300 + 6 * T)), SamplingParams(max_tokens=8),
                eos_token_ids=frozenset({0}))
    hit, n = kv.get_computed_blocks(z)
    assert n == 2 * T
    table = kv.allocate_slots(z, 6 * T, hit)  # as the scheduler calls it: computed tokens set after
    assert table is not None and table[0][:3] == [0, 1, 16 + 2]
    kv.free(x)
    kv.free(z)
    y = Request("y", list(range(100, 100 + 2 * T)) + list(range(300, 300 + 4 * T)) + list(range(500, 500 + 9 * T)),
                SamplingParams(max_tokens=8), eos_token_ids=frozenset({0}))
    hit, n = kv.get_computed_blocks(y)
    assert n == 6 * T and len({t // 16 for t in hit[0]}) == 2  # the hit spans two rows
    assert kv.fits_alone(y.num_tokens, 64)
    assert kv.allocate_slots(y, y.num_tokens - n, hit) is None  # nothing runs, and still it cannot go
    hit, n = kv.get_computed_blocks(y)
    assert n == 0  # withdrawn
    assert kv.allocate_slots(y, y.num_tokens) is not None  # alone in a row: two pages
    kv.check_invariants(["y"])


def test_room_is_made_a_whole_page_at_a_time_and_keeps_the_rest_of_the_cache() -> None:
    """Pages of 4 tiles, a budget of 3 pages: a finished request's row holds pages 0-2 (tiles 0-8
    cached, tile 9 not). Another request needs a page: page 2 goes whole (cached tile 8 with
    uncached tile 9: tile 9 alone would free nothing), and tiles 0-7 stay cached (giving back a
    page's worth of tiles from the row's end, 5-8, would have dropped three for nothing)."""
    from brisk.core.virtual_kv import PageModel

    kv = VirtualKVManager(2, 16, T, 12, enable_prefix_caching=True, commit_ahead=False,
                          pages=PageModel(4096, {1024: 1}))
    a = _req("a", 9 * T + 1)
    assert kv.allocate_slots(a, a.num_tokens) == [list(range(10))]
    kv.free(a)
    assert kv.num_cached_tiles == 9 and kv.pages is not None and kv.pages.bytes == 3 * 4096
    b = Request("b", [1] * (4 * T), SamplingParams(max_tokens=8), eos_token_ids=frozenset({0}))
    assert kv.allocate_slots(b, 4 * T) == [[16, 17, 18, 19]]
    assert kv.take_memory_ops()[1:] == [MemoryOp("release", 0, 8, 2), MemoryOp("populate", 1, 0, 4)]
    assert kv.num_cached_tiles == 8 + 4 and kv.pages.bytes == 3 * 4096
    assert kv.get_computed_blocks(_req("replay", 9 * T + 1)) == ([list(range(8))], 8 * T)
    kv.check_invariants(["b"])


def test_tiles_beside_a_named_one_go_where_they_free_pages_of_another_tensor() -> None:
    """Tiles of 3 KiB and 1 KiB on 4 KiB pages share pages in runs of 4 (tiles 0-3: pages 0-2 of the
    first tensor, page 0 of the second). A short request names tile 0 of a warm row; its stale
    tiles 1-3 still hold pages 1-2 of the first tensor alone, so under pressure they go with 4-7,
    while tile 0 and its pages stay."""
    from brisk.core.virtual_kv import PageModel

    kv = VirtualKVManager(3, 8, T, 10, commit_ahead=False, pages=PageModel(4096, {3072: 1, 1024: 1}))
    a = _req("a", 8 * T)
    assert kv.allocate_slots(a, 8 * T) == [list(range(8))]  # 32 KiB: 8 tiles' worth of the 10
    kv.free(a)
    s = _req("s", 3)
    assert kv.allocate_slots(s, 3) == [[0]]  # the warm row: tile 0 is there already
    b = _req("b", 6 * T)
    table = kv.allocate_slots(b, 6 * T)  # 28 KiB more: 20 KiB over, of which tiles 4-7 free 16
    assert table is not None and len(table[0]) == 6 and table[0][0] // 8 != 0
    assert kv.take_memory_ops()[1] == MemoryOp("release", 0, 1, 7)
    assert kv.pages is not None and kv.pages.bytes == 4096 + 4096 + 28 * 1024  # tile 0's two pages, and b's
    kv.check_invariants(["s", "b"])
