"""Scheduler with speculative slots, on fabricated verifier outputs: exact slots, rollback, bounds."""

from __future__ import annotations

from brisk.request import FinishReason
from tests.core.test_scheduler import BS, EOS, make, make_sched


def _prefill(sched, req) -> None:  # type: ignore[no-untyped-def]
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, {req.request_id: [7]})


def test_decode_reserves_draft_slots_and_rolls_back_rejected_ones() -> None:
    sched = make_sched(budget=64)
    req = make("a", 6, max_tokens=20)
    _prefill(sched, req)  # 6 prompt tokens + 7: num_tokens 7, computed 6
    out = sched.schedule({"a": 4})
    (s,) = out.scheduled
    # t_last (7) at position 6, draft slots at 7..10: blocks for 11 tokens (3 blocks of 4)
    assert (s.token_ids, s.start_pos, s.num_spec_slots, s.block_ids[0]) == ([7], 6, 4, [0, 1, 2])
    assert out.num_batched_tokens == 5 and req.num_computed_tokens == 7
    # the verifier kept 2 drafts (20, 21) and added a correction (22)
    sched.update_from_output(out, {"a": [20, 21, 22]})
    sched.check_invariants()
    assert req.output_token_ids == [7, 20, 21, 22] and req.num_computed_tokens == 9 == req.num_tokens - 1
    out = sched.schedule({"a": 4})
    (s,) = out.scheduled  # the rejected slots 9, 10 are reused: the next step starts at 9
    assert (s.token_ids, s.start_pos, s.num_spec_slots, s.block_ids[0]) == ([22], 9, 4, [0, 1, 2, 3])


def test_draft_slots_stay_within_budget_max_tokens_and_context() -> None:
    sched = make_sched(budget=3)
    req = make("a", 2, max_tokens=20)
    _prefill(sched, req)
    (s,) = sched.schedule({req.request_id: 8}).scheduled
    assert s.num_spec_slots == 2  # budget 3 = t_last + 2 drafts

    sched = make_sched(budget=64)
    req = make("b", 2, max_tokens=4)
    _prefill(sched, req)  # one output so far: 3 more allowed, one of them the bonus token
    (s,) = sched.schedule({req.request_id: 8}).scheduled
    assert s.num_spec_slots == 2

    sched = make_sched(budget=64, max_len=12)
    req = make("c", 8, max_tokens=50)
    _prefill(sched, req)  # 9 tokens of a 12-token context: 2 more + ... all drafts and bonus must fit
    (s,) = sched.schedule({req.request_id: 8}).scheduled
    assert s.num_spec_slots == 2


def _two_running(num_blocks: int, b_prompt: int):  # type: ignore[no-untyped-def]
    """Requests a (7 prompt tokens) and b (b_prompt), both past their prompt with one output."""
    sched = make_sched(budget=64, num_blocks=num_blocks)
    a, b = make("a", 7, max_tokens=20), make("b", b_prompt, max_tokens=20, base=2000)
    sched.add_request(a)
    sched.add_request(b)
    sched.update_from_output(sched.schedule(), {"a": [7], "b": [7]})
    return sched, a, b


def test_drafts_are_dropped_before_anyone_is_preempted() -> None:
    sched, a, b = _two_running(num_blocks=4, b_prompt=7)  # 2 blocks each: the pool is full
    out = sched.schedule({"a": 4, "b": 4})
    assert [s.num_spec_slots for s in out.scheduled] == [0, 0] and not out.preempted_ids
    sched.check_invariants()


def test_stop_token_among_accepted_drafts_ends_there() -> None:
    sched = make_sched()
    req = make("a", 5, max_tokens=20)
    _prefill(sched, req)
    out = sched.schedule({"a": 4})
    sched.update_from_output(out, {"a": [30, EOS, 31]})  # EOS accepted mid-way: 31 never counts
    assert req.output_token_ids == [7, 30, EOS] and req.finish_reason == FinishReason.STOP
    assert sched.kv.num_free_blocks == 16
    sched.check_invariants()


def test_prefix_cache_never_publishes_draft_slots() -> None:
    sched = make_sched()
    req = make("a", 3, max_tokens=20)
    _prefill(sched, req)  # 4 known tokens: block 0 becomes full only once token 3 (7) is computed
    out = sched.schedule({"a": 4})  # computes t_last 7 at slot 3 and drafts at 4..7 (block 1)
    cached = {b.block_id for b in sched.kv.pool.blocks if b.block_hash is not None}
    assert cached == {0}
    sched.update_from_output(out, {"a": [40]})  # every draft rejected
    assert [b.block_id for b in sched.kv.pool.blocks if b.block_hash is not None] == [0]
    assert req.num_computed_tokens == 4 == BS


def test_drafts_never_take_another_decode_s_budget() -> None:
    sched = make_sched(budget=6, max_seqs=4)
    reqs = [make(f"r{i}", 1, max_tokens=20, base=100 * i) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    sched.update_from_output(sched.schedule(), {r.request_id: [7] for r in reqs})  # four 1-token prompts
    out = sched.schedule({r.request_id: 8 for r in reqs})  # 4 decodes in a budget of 6: 2 draft slots in
    # all, for the first request
    assert [s.num_spec_slots for s in out.scheduled] == [2, 0, 0, 0]
    assert out.num_batched_tokens == 6


def test_drafts_never_take_a_block_another_decode_needs() -> None:
    sched, a, _ = _two_running(num_blocks=5, b_prompt=8)  # a: 2 blocks, b: 2 full blocks; 1 free
    out = sched.schedule({"a": 4})  # a's drafts would need the free block; b's next token needs it
    assert not out.preempted_ids and [s.num_spec_slots for s in out.scheduled] == [0, 0]
    assert [len(s.block_ids[0]) for s in out.scheduled] == [2, 3]
    sched.check_invariants()


def test_waiting_prompts_come_before_drafts() -> None:
    sched = make_sched(budget=8)
    a = make("a", 3, max_tokens=20)
    _prefill(sched, a)
    sched.add_request(make("b", 6, max_tokens=20, base=500))
    out = sched.schedule({"a": 6})  # a's decode (1) and b's whole prompt (6) first; one token left for a draft
    assert [(s.request_id, s.num_tokens, s.num_spec_slots) for s in out.scheduled] == [("a", 1, 1), ("b", 6, 0)]
