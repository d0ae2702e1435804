"""KV groups and sliding-window block tables: which layers share a table, which blocks a sliding
group lets go, what a prefix hit needs from it, and what a long request holds in the end."""

from __future__ import annotations

import pytest

from brisk.config import ModelConfig, SchedulerConfig
from brisk.core.kv_cache_manager import NO_BLOCK, KVCacheManager
from brisk.core.kv_groups import KVGroup, kv_groups, layer_slots
from brisk.core.scheduler import Scheduler
from brisk.request import Request, SamplingParams

BS = 4


def _gemma_like(layers: int = 18, window: int = 512) -> ModelConfig:
    types = tuple("sliding" if (i + 1) % 6 else "full" for i in range(layers))
    return ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=1, layer_types=types, sliding_window=window)


def test_gemma_pattern_splits_into_equal_groups() -> None:
    groups = kv_groups(_gemma_like(), max_model_len=8192)
    assert groups[0] == KVGroup(0, (5, 11, 17))
    assert [g.window for g in groups] == [0] + [512] * 5
    assert [g.layers for g in groups[1:]] == [(0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)]
    group_of, slot_of = layer_slots(groups, 18)
    assert (group_of[6], slot_of[6]) == (2, 2) and (group_of[17], slot_of[17]) == (0, 2)


def test_one_group_when_nothing_slides() -> None:
    plain = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=1)
    assert kv_groups(plain, 100) == (KVGroup(0, (0, 1, 2, 3)),)
    # a window as long as every sequence served never slides: Gemma's layers are one full group then
    assert kv_groups(_gemma_like(window=512), max_model_len=512) == (KVGroup(0, tuple(range(18))),)
    mistral = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=1, layer_types=("sliding",) * 2,
                          sliding_window=8)
    assert kv_groups(mistral, 100) == (KVGroup(8, (0, 1)),)


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=64, ignore_eos=True))


def _table_ids(kv: KVCacheManager, rid: str) -> list[list[int]]:
    return kv.get_block_ids(rid)


def test_a_sliding_group_lets_go_of_blocks_before_its_window() -> None:
    kv = KVCacheManager(64, BS, enable_prefix_caching=True, windows=(0, 6))
    req = _req("a", list(range(12)))
    assert kv.allocate_slots(req, 12) == [[0, 1, 2], [3, 4, 5]]
    req.num_computed_tokens = 12
    # the next query (position 12) sees 7..12 with a window of 6: block 0 (tokens 0..3) can go
    req.output_token_ids.append(50)
    tables = kv.allocate_slots(req, 1)
    assert tables == [[0, 1, 2, 6], [NO_BLOCK, 4, 5, 7]]
    assert kv.pool.blocks[3].ref_cnt == 0 and kv.pool.blocks[3].is_cached  # free, still a hit candidate
    kv.check_invariants(["a"])
    kv.free(req)
    kv.check_invariants([])


def test_a_prefix_hit_needs_only_the_window_before_its_end() -> None:
    kv = KVCacheManager(64, BS, enable_prefix_caching=True, windows=(0, 6))
    a = _req("a", list(range(20)))
    kv.allocate_slots(a, 20)
    a.num_computed_tokens = 20
    kv.free(a)
    b = _req("b", list(range(20)) + [99])
    hit, n = kv.get_computed_blocks(b)
    # 5 full blocks cached; the next query at 20 sees 15..20: the sliding group needs block 3 (12..15) on
    assert n == 20 and hit[0] == [0, 1, 2, 3, 4] and hit[1] == [NO_BLOCK] * 3 + [8, 9]
    assert kv.allocate_slots(b, 1, hit) is not None
    kv.check_invariants(["b"])
    kv.free(b)
    # the sliding group's block of tokens 12..15 leaves the cache: hits of 20 or 16 tokens need it
    # (their next queries see 15.. and 11..); one of 12 tokens needs 7..11 only: blocks 6 and 7
    kv.pool.uncache([8])
    c = _req("c", list(range(20)) + [98])
    hit, n = kv.get_computed_blocks(c)
    assert n == 12 and hit[1] == [NO_BLOCK, 6, 7]
    assert kv.allocate_slots(c, c.num_tokens - n, hit) is not None
    kv.check_invariants(["c"])


def test_blocks_needed_caps_sliding_groups_at_their_window() -> None:
    kv = KVCacheManager(64, 16, enable_prefix_caching=True, windows=(0,) + (512,) * 5)
    # 4,000 tokens: 250 blocks for the full group; a sliding group at most its window plus a chunk
    assert kv.window_blocks(512, 512) == 65
    assert kv.blocks_needed(4000, 512) == 250 + 5 * 65
    assert kv.blocks_needed(100, 512) == 6 * 7  # short: every group holds the whole sequence


def test_a_long_request_holds_the_full_layers_kv_plus_the_windows() -> None:
    """A 4,000-token request on Gemma 3 270M's layer pattern (18 layers, window 512, blocks of 16),
    prefilled in chunks of 512 and decoded: the blocks it holds, and their layers' worth, against
    one table for every layer."""
    groups = kv_groups(_gemma_like(), max_model_len=8192)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=4, max_model_len=8192),
                      KVCacheManager(2000, 16, True, [g.window for g in groups]))
    req = _req("long", [i % 50 for i in range(4000)])
    req.eos_token_ids = frozenset()
    sched.add_request(req)
    peak = 0
    for _ in range(8 + 16):  # 8 prompt chunks, then 16 decodes
        out = sched.schedule()
        sched.update_from_output(out, {s.request_id: [7] for s in out.scheduled if s.sample})
        sched.check_invariants()
        peak = max(peak, sched.kv.num_blocks - sched.kv.num_free_blocks)
    tables = sched.kv.get_block_ids("long")
    tokens = req.num_computed_tokens  # 4015 computed
    full_blocks = -(-tokens // 16)
    held = [sum(b != NO_BLOCK for b in t) for t in tables]
    assert held[0] == full_blocks == 251
    # the last step's query (position 4014) saw 3503..4014; blocks are let go one token early (a
    # decode token's query precedes its draft slots): each sliding group holds blocks 218..250
    assert held[1:] == [full_blocks - (4014 - 1 - 512 + 1) // 16] * 5 == [33] * 5
    in_use = sched.kv.num_blocks - sched.kv.num_free_blocks
    assert in_use == 251 + 5 * 33
    layers_per_block = len(groups[0].layers)  # each block holds 3 layers' KV
    all_full = full_blocks * 18  # layer-blocks with one table for all 18 layers
    assert in_use * layers_per_block == 251 * 3 + 15 * 33 < all_full / 3.5
    assert peak <= 251 + 5 * 65


def test_draft_slots_keep_the_decode_tokens_window() -> None:
    """Draft slots are allocated after their step's decode token advanced the request: the
    decode query (position 8, window 6: keys 3..8) still needs block 0."""
    kv = KVCacheManager(16, BS, enable_prefix_caching=False, windows=(6,))
    req = _req("a", list(range(8)))
    kv.allocate_slots(req, 8)
    req.num_computed_tokens = 8
    req.output_token_ids.append(9)
    kv.allocate_slots(req, 1)  # the decode token at position 8
    req.num_computed_tokens = 9  # the scheduler advances it, then asks for 4 draft slots
    tables = kv.allocate_slots(req, 4)
    assert tables is not None and tables[0][0] != NO_BLOCK
    kv.check_invariants(["a"])
