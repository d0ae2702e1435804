"""BlockPool: exact block ids, reference counts and eviction order."""

from __future__ import annotations

import pytest

from brisk.core.block_pool import BlockPool
from brisk.core.kv_cache_manager import hash_block


def toks(start: int) -> tuple[int, ...]:
    return (start, start + 1, start + 2, start + 3)


def test_new_blocks_come_from_the_front_in_id_order() -> None:
    pool = BlockPool(8, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 5
    assert pool.free_block_ids() == [3, 4, 5, 6, 7]
    assert pool.usage == 3 / 8


def test_free_puts_cached_blocks_at_the_end_and_empty_ones_at_the_front() -> None:
    pool = BlockPool(8, enable_caching=True)
    b0, b1, b2 = pool.get_new_blocks(3)
    h0 = hash_block(None, toks(0))
    h1 = hash_block(h0, toks(4))
    pool.cache_full_block(b0, h0, toks(0))
    pool.cache_full_block(b1, h1, toks(4))
    pool.free_blocks([b2, b1, b0])  # a request frees tail first
    # b2 holds nothing worth keeping: reused first. Cached ones: tail (b1) evicted before head (b0).
    assert pool.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert pool.usage == 0.0
    # Still cached while free.
    assert pool.get_cached_block(h0, toks(0)) is b0
    assert pool.get_cached_block(h1, toks(4)) is b1


def test_touch_revives_a_free_cached_block_and_shares_a_held_one() -> None:
    pool = BlockPool(4, enable_caching=True)
    (b0,) = pool.get_new_blocks(1)
    h0 = hash_block(None, toks(0))
    pool.cache_full_block(b0, h0, toks(0))
    pool.touch([b0])
    assert b0.ref_cnt == 2
    pool.free_blocks([b0])
    pool.free_blocks([b0])
    assert b0.ref_cnt == 0 and pool.free_block_ids() == [1, 2, 3, 0]
    pool.touch([b0])  # a prefix hit pulls it out of the middle of the free queue
    assert b0.ref_cnt == 1 and pool.free_block_ids() == [1, 2, 3]
    assert pool.get_cached_block(h0, toks(0)) is b0


def test_eviction_is_least_recently_freed_first_and_drops_the_hash() -> None:
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    hashes = [hash_block(None, toks(4 * i)) for i in range(3)]
    for b, h, i in zip(blocks, hashes, range(3)):
        pool.cache_full_block(b, h, toks(4 * i))
    pool.free_blocks([blocks[1]])
    pool.free_blocks([blocks[0]])
    pool.free_blocks([blocks[2]])
    assert pool.free_block_ids() == [1, 0, 2]
    (got,) = pool.get_new_blocks(1)
    assert got.block_id == 1 and got.block_hash is None and got.token_ids is None and got.ref_cnt == 1
    assert pool.get_cached_block(hashes[1], toks(4)) is None  # evicted: no longer hit
    assert pool.get_cached_block(hashes[0], toks(0)) is blocks[0]  # the others survive
    assert [b.block_id for b in pool.get_new_blocks(2)] == [0, 2]
    assert pool.cached_items() == []


def test_a_hash_hit_is_verified_against_the_stored_tokens() -> None:
    pool = BlockPool(2, enable_caching=True)
    (b0,) = pool.get_new_blocks(1)
    fake_hash = b"x" * 32
    pool.cache_full_block(b0, fake_hash, toks(0))
    assert pool.get_cached_block(fake_hash, toks(0)) is b0
    assert pool.get_cached_block(fake_hash, toks(100)) is None  # same hash, other tokens: miss


def test_duplicate_content_keeps_the_first_block_published() -> None:
    pool = BlockPool(4, enable_caching=True)
    b0, b1 = pool.get_new_blocks(2)
    h = hash_block(None, toks(0))
    pool.cache_full_block(b0, h, toks(0))
    pool.cache_full_block(b1, h, toks(0))
    assert b1.block_hash is None and pool.get_cached_block(h, toks(0)) is b0
    pool.free_blocks([b1, b0])
    assert pool.free_block_ids() == [1, 2, 3, 0]  # the private duplicate is reused first


def test_caching_disabled_never_publishes() -> None:
    pool = BlockPool(2, enable_caching=False)
    (b0,) = pool.get_new_blocks(1)
    h = hash_block(None, toks(0))
    pool.cache_full_block(b0, h, toks(0))
    assert b0.block_hash is None and pool.get_cached_block(h, toks(0)) is None


def test_misuse_is_loud() -> None:
    pool = BlockPool(2, enable_caching=True)
    with pytest.raises(RuntimeError, match="asked for 3 KV blocks but only 2 are free"):
        pool.get_new_blocks(3)
    (b0,) = pool.get_new_blocks(1)
    pool.free_blocks([b0])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([b0])
    with pytest.raises(ValueError):
        BlockPool(0, enable_caching=True)
