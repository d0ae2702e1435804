"""The virtual KV layout over pages that hold many tiles (CUDA's 2 MiB pages): a page is mapped while
any committed tile touches it, whatever runs the manager commits and releases tiles in. On the CPU a
stand-in device (`FakePages`) plays the driver: it fills a page with NaN bytes when it maps it
(fresh device memory holds anything) and when it unmaps it, so a kernel reading a slot nobody wrote,
or a page already given back, changes the tokens. The real driver runs under the `cuda` marker."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import brisk.runtime.virtual_kv as vkv
from brisk.engine.llm_engine import LLMEngine
from brisk.errors import UserError
from brisk.request import SamplingParams
from tests.runtime.test_virtual_layout import _finish, _step_all, _submit, _tiny_engine

GARBAGE = 0xFF  # every float32 made of these bytes is a NaN


class FakePages(vkv.DevicePages):
    """A device whose reservations are CPU tensors; maps and unmaps are recorded and scribbled on."""

    def __init__(self, page: int) -> None:
        super().__init__(page)
        self.tensors: dict[int, torch.Tensor] = {}
        self.maps: list[int] = []
        self.unmaps: list[int] = []
        self.syncs = 0
        self.freed = 0
        self.entered = 0
        self.fail_after: int | None = None  # maps that succeed before one fails (out of memory)
        self.fail_once = False  # that one fails, the later ones succeed (memory freed meanwhile)
        self.fail_in = 0  # ...and only a map in this reservation (0, 1, ...: the order they were made) fails

    def _reserve(self, nbytes: int) -> int:
        t = torch.full((nbytes,), GARBAGE, dtype=torch.uint8)
        self.tensors[t.data_ptr()] = t
        return t.data_ptr()

    def _tensor(self, base: int, nbytes: int) -> torch.Tensor:
        return self.tensors[base]

    def _scribble(self, address: int) -> None:
        base = max(b for b in self.tensors if b <= address)
        self.tensors[base][address - base:address - base + self.page] = GARBAGE

    def _enter(self) -> None:
        self.entered += 1

    def _map(self, address: int) -> Any:
        base = max(b for b in self.tensors if b <= address)
        if (self.fail_after is not None and len(self.maps) >= self.fail_after
                and list(self.tensors).index(base) >= self.fail_in):
            if self.fail_once:
                self.fail_after = None
            raise UserError("out of device memory")
        self._scribble(address)
        self.maps.append(address)
        return ("handle", address)

    def _unmap(self, address: int, handle: Any) -> None:
        assert handle == ("handle", address)
        self._scribble(address)
        self.unmaps.append(address)

    def _free(self, base: int, nbytes: int) -> None:
        self.freed += 1

    def _sync(self) -> None:
        self.syncs += 1


def test_a_page_is_mapped_while_any_committed_tile_touches_it() -> None:
    pages = FakePages(page=16384)
    buf = pages.reserve(10 * 3072, huge_pages=False)  # tiles of 3 KiB: tile 5 straddles pages 0 and 1
    assert buf.numel() == 2 * 16384
    pages.populate(buf, 3072, 0, 6)
    assert pages.resident(buf) == 2 * 16384 and len(pages.maps) == 2
    pages.release(buf, 3072, 0, 5)  # page 0 still holds tile 5's first bytes
    assert pages.resident(buf) == 2 * 16384 and not pages.unmaps and pages.syncs == 0
    pages.populate(buf, 3072, 6, 2)  # page 1 already mapped: no new map
    assert len(pages.maps) == 2
    pages.release(buf, 3072, 5, 1)
    assert pages.unmaps == [buf.data_ptr()] and pages.syncs == 1  # kernels drained before the unmap
    pages.release(buf, 3072, 6, 1)
    pages.release(buf, 3072, 7, 1)
    assert pages.resident(buf) == 0 and pages.unmaps == [buf.data_ptr(), buf.data_ptr() + 16384]
    with pytest.raises(AssertionError, match="released twice"):
        pages.release(buf, 3072, 7, 1)


def test_mapped_pages_are_zeroed_and_a_failed_commit_leaves_nothing_behind() -> None:
    pages = FakePages(page=4096)
    buf = pages.reserve(8 * 4096, huge_pages=False)
    pages.populate(buf, 1024, 0, 2)  # page 0, scribbled by the "driver", zeroed before use
    assert int(buf[:4096].sum()) == 0 and pages.entered == 1
    buf[:2048] = 7  # tiles 0-1 written
    pages.fail_after = 3  # pages 1 and 2 map, page 3 does not
    with pytest.raises(UserError, match="out of device memory"):
        pages.populate(buf, 1024, 2, 14)  # tiles 2..15: pages 0 (shared), 1, 2, 3
    assert pages.resident(buf) == 4096 and len(pages.unmaps) == 2  # back to page 0 alone
    assert int(buf[:2048].float().mean()) == 7  # the page that stayed kept its tiles
    pages.fail_after = None
    pages.populate(buf, 1024, 2, 14)
    assert pages.resident(buf) == 4 * 4096
    pages.release(buf, 1024, 0, 16)
    assert pages.resident(buf) == 0  # the counts were rolled back exactly


def test_release_all_and_close_give_every_page_back() -> None:
    pages = FakePages(page=8192)
    a, b = pages.reserve(5000, huge_pages=False), pages.reserve(40000, huge_pages=False)
    assert a.numel() == 8192 and b.numel() == 40960  # whole pages
    pages.populate(a, 1000, 0, 5)
    pages.populate(b, 1000, 3, 30)
    pages.release_all(a)
    assert pages.resident(a) == 0 and pages.resident(b) == 5 * 8192  # bytes 3,000..33,000
    pages.populate(a, 1000, 2, 1)  # counts start afresh after release_all
    pages.close()
    assert pages.freed == 2 and len(pages.unmaps) == len(pages.maps)
    with pytest.raises(UserError, match="kv_huge_pages"):
        FakePages(page=8192).reserve(100, huge_pages=True)


def _engine(layout: str, monkeypatch: pytest.MonkeyPatch | None = None, page: int = 16384,
            device: str = "cpu", padded: bool = False, enable_prefix_caching: bool = True, **cache: Any) -> LLMEngine:
    """test_virtual_layout's tiny random model over `FakePages` of `page` bytes (with
    `monkeypatch`); `padded`: short spans through one padded SDPA (the path CUDA takes), module by
    module; on CUDA both layouts run without graphs, through the same kernels."""
    if monkeypatch is not None:
        monkeypatch.setattr(vkv, "default_backing", lambda device: FakePages(page))
    engine = _tiny_engine(layout, enable_prefix_caching, device, eager=padded or device != "cpu", **cache)
    if padded:
        engine.runner.short_spans = "padded"
    return engine


def _prompts() -> list[list[int]]:
    return [[(7 * i + 13 * j) % 400 + 100 for j in range(n)] for i, n in enumerate([1, 5, 17, 40, 90, 200, 333, 700])]


def _run(engine: LLMEngine, prompts: list[list[int]], resident: list[int] | None = None,
         max_tokens: int = 40, prefix: str = "", after_step: Any = None) -> list[list[int]]:
    """The greedy tokens of `prompts`; `resident`: the committed bytes after every step."""
    def record() -> None:
        if resident is not None:
            resident.append(engine.runner.virtual.resident_bytes())
        if after_step is not None:
            after_step()
    return _finish(engine, _submit(engine, prompts, max_tokens, prefix), record)


def test_shared_pages_give_the_paged_layouts_tokens_with_preemption(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of 16 tokens (1 KiB a tensor) on 16 KiB pages, a budget small enough to preempt:
    every token the paged layout's, though pages are scribbled on when mapped and unmapped."""
    prompts = _prompts()
    paged = _run(_engine("paged", num_kv_blocks=96, block_size=16, enable_prefix_caching=False), prompts)
    engine = _engine("virtual", monkeypatch, num_kv_blocks=96, block_size=16, enable_prefix_caching=False)
    backing = engine.runner.virtual.backing
    assert isinstance(backing, FakePages) and engine.virtual_kv.block_size == 16  # not doubled to whole pages
    resident: list[int] = []
    assert _run(engine, prompts, resident) == paged
    assert engine.scheduler.num_preemptions > 0
    assert max(resident) > 0 and resident[-1] == 0 and backing.unmaps  # idle: every page given back
    assert max(resident) <= 96 * engine.runner.virtual.bytes_per_tile  # the pages are what is budgeted


def _warm_row_then_pressure(engine: LLMEngine) -> dict[str, list[int]]:
    """A 700-token request finishes while another keeps the engine busy (so its row keeps its
    tiles: deferred reclamation), a short request takes that warm row, then long ones press the
    budget: the outputs of all."""
    params = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    engine.add_request("keeper", [(13 * j) % 400 + 100 for j in range(30)], params(300))
    engine.add_request("long", [(5 * j) % 400 + 100 for j in range(700)], params(4))
    done: dict[str, list[int]] = {}
    added = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if "long" in done and not added:
            added = True
            engine.add_request("short", [(11 * j) % 400 + 100 for j in range(20)], params(120))
            engine.step()  # the short one is admitted alone: the warmest free row is the long one's
            for i in range(3):
                engine.add_request(f"press{i}", [(7 * i + 3 * j) % 400 + 100 for j in range(480)], params(60))
        engine.scheduler.check_invariants()
    return done


def test_a_shorter_request_in_a_warm_row_keeps_the_stale_tiles_on_its_pages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under pressure the warm row's stale tiles beyond the short request's table are given back a
    page at a time: those sharing a page with its live tiles stay (giving them back frees nothing),
    the rest go, and the short request's tokens are the paged layout's."""
    paged = _warm_row_then_pressure(_engine("paged", num_kv_blocks=100, block_size=16, enable_prefix_caching=False))
    engine = _engine("virtual", monkeypatch, page=32768, num_kv_blocks=100, block_size=16,
                     enable_prefix_caching=False)
    manager, tile_bytes = engine.virtual_kv, engine.runner.virtual.tile_bytes[0]
    beside: list[int] = []  # tiles given back on a page of the short request's tiles
    elsewhere: list[int] = []  # the short request's row's tiles given back on other pages
    release = manager._release

    def watched(tiles: list[int]) -> None:
        table = manager.get_block_ids("short")[0]
        if table:
            live = {t * tile_bytes // 32768 for t in table}
            row = manager.row_of("short")
            for t in tiles:
                if t * tile_bytes // 32768 in live:
                    beside.append(t)
                elif t // manager.row_tiles == row:
                    elsewhere.append(t)
        release(tiles)
    manager._release = watched  # type: ignore[method-assign]
    assert _warm_row_then_pressure(engine) == paged
    assert elsewhere and not beside  # the pressure reached the warm row; its live pages kept every tile


def test_cached_tiles_keep_the_page_they_share_with_tiles_given_back_at_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """At idle the uncached tiles (a partial last tile, the decoded ones) are given back, while the
    prefix cache keeps the full tiles on the same page: the page stays mapped (a page unmapped on
    any release instead of its last would be scribbled on), and a request hitting the cached tiles
    gets the paged layout's tokens."""
    prompt = [(7 * j) % 400 + 100 for j in range(100)]  # 6 full tiles of 16, a partial 7th
    again = prompt[:96] + [(3 * j) % 400 + 100 for j in range(20)]

    def run(engine: LLMEngine) -> list[list[int]]:
        return [_run(engine, [p], max_tokens=12)[0] for p in (prompt, again)]
    paged = run(_engine("paged", num_kv_blocks=64, block_size=16))
    engine = _engine("virtual", monkeypatch, page=32768, num_kv_blocks=64, block_size=16)
    backing, manager = engine.runner.virtual.backing, engine.virtual_kv
    assert isinstance(backing, FakePages)
    first = _run(engine, [prompt], max_tokens=12)[0]
    assert manager.num_cached_tiles == 6 and manager.num_committed == 6  # the uncached ones went at idle
    assert engine.runner.virtual.resident_bytes() > 0  # and the page the cached ones sit on stayed
    hits = manager.prefix_cache_hits
    assert [first, _run(engine, [again], max_tokens=12)[0]] == paged
    assert manager.prefix_cache_hits - hits == 96


def test_a_failed_commit_ends_the_requests_that_needed_it_and_the_rest_go_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device memory runs out once, mid-run: the requests whose tiles the failed commit was for
    end with a clear error, every other request gets the paged layout's tokens, and nothing stays
    committed or counted (the tiles of a half-done commit, in the tensors it reached, too)."""
    prompts = _prompts()
    paged = _run(_engine("paged", num_kv_blocks=96, block_size=16, enable_prefix_caching=False), prompts)
    engine = _engine("virtual", monkeypatch, page=4096, num_kv_blocks=96, block_size=16, enable_prefix_caching=False)
    backing = engine.runner.virtual.backing
    assert isinstance(backing, FakePages)
    ids = _submit(engine, prompts, 40)
    for _ in range(6):
        engine.step()
    # a later commit fails at the second layer's keys: the first layer's tensors were committed
    backing.fail_after, backing.fail_once, backing.fail_in = len(backing.maps) + 3, True, 2
    done = _step_all(engine)
    failed = engine.take_failures()
    assert failed and all("could not commit memory" in str(e) and "out of device memory" in str(e)
                          for e in failed.values())
    assert set(failed) | set(done) == set(ids) and not set(failed) & set(done)
    assert all(done[i] == paged[int(i)] for i in done)
    assert engine.virtual_kv.num_committed == 0 and engine.runner.virtual.resident_bytes() == 0


def test_padded_spans_read_only_mapped_written_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's way for short spans, one padded SDPA over every table: the padding and the tail of
    each last tile are read (masked). With tables padded by block 0, a batch of uneven tables
    read row 0's first page after it was given back (NaN here, an illegal address on a GPU)."""
    prompts = _prompts()
    paged = _run(_engine("paged", padded=True, num_kv_blocks=96, block_size=16, enable_prefix_caching=False),
                 prompts)
    engine = _engine("virtual", monkeypatch, padded=True, num_kv_blocks=96, block_size=16,
                     enable_prefix_caching=False)
    assert engine.runner.short_spans == "padded"
    assert _run(engine, prompts) == paged
    assert engine.scheduler.num_preemptions > 0
    # uneven tables are padded with their own first tile, which their request keeps mapped
    from brisk.core.outputs import ScheduledRequest

    rt = engine.virtual_kv.row_tiles
    steps = [ScheduledRequest("a", [1], 40, [[rt, rt + 1, rt + 2]], True),
             ScheduledRequest("b", [2], 3, [[3 * rt]], True)]
    inputs = engine.runner.prepare(steps)
    assert inputs.attn.padded.block_tables[0].tolist() == [[rt, rt + 1, rt + 2], [3 * rt] * 3]


def test_rows_are_whole_pages_where_pages_hold_many_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine("virtual", monkeypatch, page=32768, num_kv_blocks=96, block_size=16)
    virtual = engine.runner.virtual
    assert engine.virtual_kv.row_tiles * virtual.tile_bytes[0] % 32768 == 0
    assert engine.virtual_kv.row_tiles * 16 >= 1100


def test_prefix_sharing_over_shared_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cached tiles read in place from another row, over pages many tiles share."""
    shared = [(3 * j) % 400 + 100 for j in range(150)]
    prompts = [shared + [200 + i] * (i + 1) for i in range(6)]
    paged = _run(_engine("paged", block_size=16, num_kv_blocks=400), prompts)
    engine = _engine("virtual", monkeypatch, block_size=16, num_kv_blocks=400)
    assert _run(engine, prompts) == paged
    assert engine.virtual_kv.hit_rate > 0


def _short_prompts() -> list[list[int]]:
    return [[(5 * i + 3 * j) % 400 + 100 for j in range(20 + i)] for i in range(16)]


def test_the_budget_counts_the_pages_tiles_occupy(monkeypatch: pytest.MonkeyPatch) -> None:
    """32 KiB pages of 16 tiles: each running request holds a page in each of the 4 tensors
    (128 KiB) for a tile or two of tokens. Counting tiles, 16 short requests would commit ~2.7x a
    96-tile budget (768 KiB); the manager counts the pages (as the device maps them), so memory
    never exceeds the budget, requests wait or are preempted, and the tokens are the paged layout's."""
    prompts = _short_prompts()
    paged = _run(_engine("paged", num_kv_blocks=96, block_size=16), prompts)
    engine = _engine("virtual", monkeypatch, page=32768, num_kv_blocks=96, block_size=16)
    virtual, manager = engine.runner.virtual, engine.virtual_kv
    budget = 96 * virtual.bytes_per_tile
    seen: list[tuple[int, int]] = []
    assert _run(engine, prompts, after_step=lambda: seen.append((virtual.resident_bytes(), manager.pages.bytes))) \
        == paged
    assert all(resident == counted <= budget for resident, counted in seen), seen
    assert max(resident for resident, _ in seen) > budget // 2  # the budget was what limited it


def test_a_budget_smaller_than_one_request_s_pages_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UserError, match="one request takes .* more than the KV budget; raise kv_cache_memory_gib"):
        _engine("virtual", monkeypatch, page=1 << 20, kv_cache_memory_gib=0.002)


def _has_cuda_driver() -> bool:
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.cuda
@pytest.mark.skipif(not _has_cuda_driver(), reason="needs a CUDA device and cuda-python's driver bindings")
def test_cuda_virtual_rows_match_paged_and_give_pages_back() -> None:
    """CUDA's own virtual memory: the paged layout's tokens, pages that follow the tokens, none
    left mapped when idle."""
    prompts = _prompts()
    paged = _run(_engine("paged", device="cuda", num_kv_blocks=96, block_size=16), prompts)
    engine = _engine("virtual", device="cuda", num_kv_blocks=96, block_size=16)
    assert isinstance(engine.runner.virtual.backing, vkv.CudaPages)
    resident: list[int] = []
    assert _run(engine, prompts, resident) == paged
    assert max(resident) > 0 and resident[-1] == 0


def test_a_tile_committed_ahead_and_released_in_the_same_ops_is_committed_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where commits ahead run on a worker thread, one whose tile the same ops give back (room
    made for another request) runs now, in order: on the worker it would come after the release."""
    from brisk.core.kv_manager import MemoryOp

    engine = _engine("virtual", monkeypatch, page=2048, num_kv_blocks=96, block_size=16)  # a page a tile
    virtual = engine.runner.virtual
    assert virtual.tile_bytes[0] == 2048
    virtual.ahead_thread = True
    virtual.apply([MemoryOp("populate", 0, 0, 2), MemoryOp("populate", 0, 2, 1, ahead=True),
                   MemoryOp("populate", 1, 0, 1, ahead=True), MemoryOp("release", 0, 2, 1)])
    virtual.wait()  # the other commit ahead, on the worker
    assert virtual.take_unbacked() == ([], None)
    virtual.apply([MemoryOp("release", 0, 0, 2), MemoryOp("release", 1, 0, 1)])
    assert virtual.resident_bytes() == 0  # every count back to zero: nothing released before its commit
