"""KVCacheManager: block tables, chained prefix hits and exact eviction on a tiny cache."""

from __future__ import annotations

import pytest

from brisk.core.kv_cache_manager import KVCacheManager, hash_block
from brisk.request import Request, SamplingParams

BS = 4


def make(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8))


def run_prompt(kv: KVCacheManager, req: Request) -> list[int]:
    """Admit a request the way the scheduler does: lookup, allocate, advance. Returns the table
    (of the only KV group)."""
    hit_ids, num_hit = kv.get_computed_blocks(req)
    block_ids = kv.allocate_slots(req, req.num_tokens - num_hit, hit_ids)
    assert block_ids is not None and len(block_ids) == 1
    req.num_computed_tokens = req.num_tokens
    return block_ids[0]


A = list(range(100, 110))  # 10 tokens: two full blocks and a partial one


def test_allocation_ids_ref_counts_and_what_gets_cached() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a = make("a", A)
    assert kv.get_computed_blocks(a) == ([[]], 0)
    assert run_prompt(kv, a) == [0, 1, 2]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 1, 0]
    # Only the full blocks are published; each one's tokens are stored with its hash.
    assert kv.pool.blocks[0].token_ids == (100, 101, 102, 103)
    assert kv.pool.blocks[1].token_ids == (104, 105, 106, 107)
    assert kv.pool.blocks[2].block_hash is None
    assert kv.get_block_ids("a") == [[0, 1, 2]] and kv.num_free_blocks == 5
    kv.check_invariants(["a"])


def test_prefix_hit_reuses_the_same_block_ids() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a = make("a", A)
    run_prompt(kv, a)
    b = make("b", A[:8] + [7, 7, 7])
    assert kv.get_computed_blocks(b) == ([[0, 1]], 8)
    assert kv.allocate_slots(b, 3, [[0, 1]]) == [[0, 1, 3]]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    kv.check_invariants(["a", "b"])
    # Freed by one holder, the shared blocks stay with the other.
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    kv.check_invariants(["b"])


def test_reset_prefix_cache_forgets_published_blocks_and_keeps_what_requests_hold() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a = make("a", A)
    run_prompt(kv, a)
    kv.free(a)
    b = make("b", A)
    run_prompt(kv, b)  # holds a's two cached blocks
    kv.reset_prefix_cache()
    assert kv.pool.cached_items() == [] and kv.get_computed_blocks(make("c", A)) == ([[]], 0)
    assert [kv.pool.blocks[i].ref_cnt for i in range(2)] == [1, 1] and kv.get_block_ids("b")[0][:2] == [0, 1]
    kv.check_invariants(["b"])


def test_hit_never_covers_the_whole_prompt() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    run_prompt(kv, make("a", A))
    # Exactly the two cached blocks' tokens: only one block is a hit, so a token is left to compute.
    b = make("b", A[:8])
    assert kv.get_computed_blocks(b) == ([[0]], 4)
    assert kv.allocate_slots(b, 4, [[0]]) == [[0, 3]]
    # The recomputed duplicate of block 1 is not published twice.
    assert kv.pool.blocks[3].block_hash is None
    c = make("c", A[:9])
    assert kv.get_computed_blocks(c) == ([[0, 1]], 8)


def test_same_block_tokens_under_another_prefix_do_not_hit() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    run_prompt(kv, make("a", A))
    b = make("b", [1, 2, 3, 4] + A[4:10])  # block 1 has A's tokens, block 0 does not
    assert kv.get_computed_blocks(b) == ([[]], 0)
    assert hash_block(None, A[4:8]) != hash_block(hash_block(None, A[:4]), A[4:8])
    assert hash_block(hash_block(None, [1, 2, 3, 4]), A[4:8]) != hash_block(hash_block(None, A[:4]), A[4:8])


def test_eviction_takes_the_tail_of_a_prefix_before_its_head_and_stale_blocks_miss() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a = make("a", A)
    run_prompt(kv, a)
    kv.free(a)
    # Partial block 2 (nothing cached) is reused first; then the never-used blocks; then A's
    # tail block 1; A's head block 0 last.
    assert kv.pool.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    c = make("c", list(range(24)))  # 6 blocks
    assert run_prompt(kv, c) == [2, 3, 4, 5, 6, 7]
    assert kv.get_computed_blocks(make("a2", A)) == ([[0, 1]], 8)  # both still cached
    d = make("d", [9, 9])
    assert run_prompt(kv, d) == [1]  # evicts A's tail
    assert kv.pool.blocks[1].block_hash is None
    assert kv.get_computed_blocks(make("a3", A)) == ([[0]], 4)  # the stale block is not hit
    kv.check_invariants(["c", "d"])


def test_no_room_returns_none_and_changes_nothing() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    a = make("a", A)
    run_prompt(kv, a)
    kv.free(a)  # blocks 0, 1 cached and free; free queue [2, 3, 1, 0]
    filler = make("f", [5] * 8)
    assert run_prompt(kv, filler) == [2, 3]
    # b would hit blocks 0 and 1 (free) and needs one new block: reviving the hits leaves none.
    b = make("b", A[:8] + [1])
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert (hit_ids, num_hit) == ([[0, 1]], 8)
    before = (kv.pool.free_block_ids(), [blk.ref_cnt for blk in kv.pool.blocks])
    assert kv.allocate_slots(b, 1, hit_ids) is None
    assert (kv.pool.free_block_ids(), [blk.ref_cnt for blk in kv.pool.blocks]) == before
    assert kv.get_block_ids("b") == [[]] and kv.prefix_cache_queries == 18
    kv.check_invariants(["f"])
    # A plain request needing three blocks does not fit either.
    assert kv.allocate_slots(make("c", list(range(12))), 12) is None
    assert kv.pool.free_block_ids() == [1, 0]


def test_chunks_publish_only_what_this_step_fills() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a = make("a", A)
    assert kv.allocate_slots(a, 5) == [[0, 1]]
    assert kv.pool.blocks[0].block_hash is not None and kv.pool.blocks[1].block_hash is None
    a.num_computed_tokens = 5
    assert kv.allocate_slots(a, 5) == [[0, 1, 2]]
    assert kv.pool.blocks[1].block_hash is not None and kv.pool.blocks[2].block_hash is None


def test_generated_tokens_are_hashed_so_a_later_turn_hits_them() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a = make("a", [1, 2, 3, 4, 5, 6])
    assert run_prompt(kv, a) == [0, 1]
    # Decode two tokens: the second block fills with generated tokens 7 and 8.
    a.output_token_ids.append(7)
    assert kv.allocate_slots(a, 1) == [[0, 1]]
    a.num_computed_tokens += 1
    assert kv.pool.blocks[1].block_hash is None  # 7 tokens computed: block 1 still partial
    a.output_token_ids.append(8)
    assert kv.allocate_slots(a, 1) == [[0, 1]]
    a.num_computed_tokens += 1
    assert kv.pool.blocks[1].token_ids == (5, 6, 7, 8)
    kv.free(a)
    turn2 = make("t2", [1, 2, 3, 4, 5, 6, 7, 8, 20, 21])
    assert kv.get_computed_blocks(turn2) == ([[0, 1]], 8)


def test_prefix_stats_count_once_per_admission() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    assert kv.hit_rate == 0.0
    run_prompt(kv, make("a", A))  # 10 queried, 0 hit
    b = make("b", A[:9])
    kv.get_computed_blocks(b)  # a lookup alone does not count: a retried request would double-count
    run_prompt(kv, b)  # 9 queried, 8 hit
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (19, 8)
    assert kv.hit_rate == pytest.approx(8 / 19)


def test_caching_disabled_never_hits_and_reuses_freed_blocks_first() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    a = make("a", A)
    assert run_prompt(kv, a) == [0, 1, 2]
    kv.free(a)
    assert kv.pool.free_block_ids() == [0, 1, 2, 3, 4, 5, 6, 7]
    b = make("b", A)
    assert kv.get_computed_blocks(b) == ([[]], 0)
    assert run_prompt(kv, b) == [0, 1, 2]
    assert kv.prefix_cache_queries == 0 and kv.hit_rate == 0.0


def test_check_invariants_catches_corruption() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    run_prompt(kv, make("a", A))
    kv.check_invariants(["a"])
    with pytest.raises(AssertionError, match="block holders"):
        kv.check_invariants([])
    kv.pool.blocks[0].ref_cnt += 1
    with pytest.raises(AssertionError, match="ref_cnt 2 but held by 1"):
        kv.check_invariants(["a"])
