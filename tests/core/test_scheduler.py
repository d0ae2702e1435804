"""Scheduler on fabricated runner outputs: exact chunks, block ids, preemption and stops."""

from __future__ import annotations

import random
import zlib
from typing import Any

import pytest

from brisk.config import SchedulerConfig
from brisk.core.outputs import SchedulerOutput
from brisk.core.kv_cache_manager import KVCacheManager
from brisk.core.scheduler import Scheduler
from brisk.request import FinishReason, Request, RequestStatus, SamplingParams

BS = 4
EOS = 2


def make_sched(budget: int = 64, max_seqs: int = 8, max_len: int = 64, chunked: bool = True,
               num_blocks: int = 16, caching: bool = True) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_len,
                          enable_chunked_prefill=chunked)
    return Scheduler(cfg, KVCacheManager(num_blocks, BS, caching))


def make(rid: str, n: int | list[int], max_tokens: int = 16, base: int = 1000, **params: Any) -> Request:
    tokens = list(range(base, base + n)) if isinstance(n, int) else list(n)
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=frozenset({EOS}))


def step(sched: Scheduler, token: int = 50,
         tokens: dict[str, int] | None = None) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step with a fabricated runner: every request that must sample gets `token`
    (or its entry in `tokens`)."""
    out = sched.schedule()
    sampled = {s.request_id: [(tokens or {}).get(s.request_id, token)] for s in out.scheduled if s.sample}
    updated = sched.update_from_output(out, sampled)
    sched.check_invariants()
    return out, updated


def chunks(out: SchedulerOutput) -> dict[str, int]:
    return {s.request_id: s.num_tokens for s in out.scheduled}


# ---------------------------------------------------------------------------------- budget


def test_one_prompt_then_decodes_exact_output() -> None:
    sched = make_sched()
    req = make("a", 6, max_tokens=3)
    sched.add_request(req)
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.request_id, s.token_ids, s.start_pos, s.block_ids[0], s.sample) == (
        "a", list(range(1000, 1006)), 0, [0, 1], True)
    assert out.num_batched_tokens == 6 and req.num_computed_tokens == 6 and req.num_cached_tokens == 0
    assert sched.update_from_output(out, {"a": [7]}) == [req]
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.token_ids, s.start_pos, s.block_ids[0], s.sample) == ([7], 6, [0, 1], True)
    sched.update_from_output(out, {"a": [8]})
    out, updated = step(sched, token=9)
    assert req.output_token_ids == [7, 8, 9] and req.status == RequestStatus.FINISHED_LENGTH
    assert req.finish_reason == FinishReason.LENGTH and updated == [req]
    assert not sched.has_unfinished() and sched.kv.num_free_blocks == 16
    assert sched.schedule().finished_ids == ["a"]


def test_token_budget_is_respected_every_step() -> None:
    sched = make_sched(budget=8)
    for i in range(5):
        sched.add_request(make(f"r{i}", 3 + 2 * i, max_tokens=4, base=100 * i))
    seen = []
    while sched.has_unfinished():
        out, _ = step(sched)
        assert out.num_batched_tokens == sum(s.num_tokens for s in out.scheduled) <= 8
        seen.append(out.num_batched_tokens)
    assert max(seen) == 8


def test_chunked_prefill_splits_a_long_prompt_while_decodes_keep_going() -> None:
    sched = make_sched(budget=8)
    sched.add_request(make("d", 3, max_tokens=10))
    step(sched)  # d: prompt in one step, now decoding
    sched.add_request(make("long", 20, base=500))
    outs = [step(sched)[0] for _ in range(3)]
    assert [chunks(o) for o in outs] == [{"d": 1, "long": 7}, {"d": 1, "long": 7}, {"d": 1, "long": 6}]
    longs = [o.scheduled[1] for o in outs]
    assert [(s.start_pos, s.sample) for s in longs] == [(0, False), (7, False), (14, True)]
    assert longs[1].token_ids == list(range(507, 514))
    # d's fifth token took block 3 in the second step, between long's chunks.
    assert [s.block_ids[0] for s in longs] == [[1, 2], [1, 2, 4, 5], [1, 2, 4, 5, 6]]
    assert outs[1].scheduled[0].block_ids[0] == [0, 3]
    assert sched.get_request("long").output_token_ids == [50]  # sampled only after the last chunk
    assert chunks(step(sched)[0]) == {"d": 1, "long": 1}


def test_without_chunked_prefill_a_prompt_that_does_not_fit_blocks_fcfs() -> None:
    sched = make_sched(budget=16, max_len=16, chunked=False)
    sched.add_request(make("d1", 2, base=10))
    sched.add_request(make("d2", 2, base=20))
    step(sched)  # both decoding now: 2 tokens of the budget each step
    sched.add_request(make("big", 15, base=30))
    sched.add_request(make("small", 2, base=60))
    out, _ = step(sched)
    assert chunks(out) == {"d1": 1, "d2": 1}  # big (15 > 14 left) waits, and small waits behind it
    assert [r.request_id for r in sched.waiting] == ["big", "small"]
    sched.abort_request("d2")
    out, _ = step(sched)
    assert chunks(out) == {"d1": 1, "big": 15}  # 1 + 15 = 16: now it fits whole; small still behind
    # With chunked prefill the same situation admits a 14-token chunk at once.
    sched = make_sched(budget=16, max_len=16, chunked=True)
    sched.add_request(make("d1", 2, base=10))
    sched.add_request(make("d2", 2, base=20))
    step(sched)
    sched.add_request(make("big", 15, base=30))
    assert chunks(step(sched)[0]) == {"d1": 1, "d2": 1, "big": 14}


def test_max_num_seqs_limits_the_running_set() -> None:
    sched = make_sched(max_seqs=2)
    for rid, n in (("a", 2), ("b", 3), ("c", 4)):
        sched.add_request(make(rid, n, max_tokens=2, base=ord(rid) * 10))
    assert chunks(step(sched)[0]) == {"a": 2, "b": 3}
    assert sched.num_running == 2 and sched.num_waiting == 1
    out, updated = step(sched)  # a and b produce their second token and finish
    assert chunks(out) == {"a": 1, "b": 1} and all(r.is_finished() for r in updated)
    assert chunks(step(sched)[0]) == {"c": 4}


# ---------------------------------------------------------------------------------- preemption


def test_preempts_the_newest_request_and_resumes_it_later() -> None:
    sched = make_sched(num_blocks=4)  # 16 token slots
    a = make("a", 7, max_tokens=4, base=100)
    b = make("b", 7, max_tokens=3, base=200)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched)
    assert [s.block_ids[0] for s in out.scheduled] == [[0, 1], [2, 3]]
    step(sched)  # both decode into their second block, which is now full (8 tokens computed)
    out, _ = step(sched)  # a needs a third block: b, the newest, is preempted
    assert out.preempted_ids == ["b"] and chunks(out) == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert list(sched.waiting) == [b] and sched.kv.get_block_ids("b")[0] == []
    assert sched.num_preemptions == 1
    # b's blocks were freed tail first: a took b's tail (block 3); b's head (block 2) stays cached.
    assert out.scheduled[0].block_ids[0] == [0, 1, 3]
    assert sched.kv.pool.free_block_ids() == [2]
    assert b.output_token_ids == [50, 50]  # generated tokens survive preemption
    out, _ = step(sched)  # a finishes (4 tokens); b cannot be admitted yet (needs 3 blocks)
    assert a.status == RequestStatus.FINISHED_LENGTH and chunks(out) == {"a": 1}
    out, _ = step(sched)
    (s,) = out.scheduled  # b resumes: its own head block is a prefix hit; the rest is recomputed
    assert (s.request_id, s.start_pos, s.block_ids[0][0], s.num_tokens, s.sample) == ("b", 4, 2, 5, True)
    assert s.token_ids == [204, 205, 206, 50, 50]
    assert b.num_cached_tokens == 0  # recorded at the first schedule only
    assert b.status == RequestStatus.FINISHED_LENGTH and b.output_token_ids == [50, 50, 50]
    assert not sched.has_unfinished() and sched.kv.num_free_blocks == 4


def test_the_newest_request_preempts_itself_when_it_alone_needs_a_block() -> None:
    sched = make_sched(num_blocks=4)
    sched.add_request(make("a", 5, base=100))
    sched.add_request(make("b", 7, base=200))
    step(sched)  # a: [0, 1], b: [2, 3]
    step(sched)  # a computed 6, b computed 8: b's next token needs a fifth block
    out, _ = step(sched)
    assert out.preempted_ids == ["b"] and chunks(out) == {"a": 1}
    assert sched.get_request("b").status == RequestStatus.PREEMPTED
    assert [r.request_id for r in sched.running] == ["a"]


def test_a_sequence_ends_when_the_whole_pool_is_full() -> None:
    sched = make_sched(num_blocks=2, max_len=64)  # 8 slots: at most 9 tokens, 8 of them computed
    req = make("a", 6, max_tokens=50)
    sched.add_request(req)
    for _ in range(10):
        step(sched)
    assert req.num_tokens == 9 and req.finish_reason == FinishReason.LENGTH


# ---------------------------------------------------------------------------------- stops


def run_to_end(req: Request, tokens: list[int], **kw: Any) -> Request:
    sched = make_sched(**kw)
    sched.add_request(req)
    it = iter(tokens)
    while sched.has_unfinished():
        step(sched, token=next(it))
    return req


def test_eos_stops_and_is_kept() -> None:
    req = run_to_end(make("a", 3), [5, 6, EOS, 7])
    assert req.output_token_ids == [5, 6, EOS]
    assert (req.status, req.finish_reason) == (RequestStatus.FINISHED_STOPPED, FinishReason.STOP)


def test_min_tokens_outputs_come_before_eos_can_stop() -> None:
    req = run_to_end(make("a", 3, min_tokens=2), [EOS, EOS, EOS, 7])
    assert req.output_token_ids == [EOS, EOS, EOS] and req.finish_reason == FinishReason.STOP


def test_ignore_eos_runs_to_max_tokens() -> None:
    req = run_to_end(make("a", 3, max_tokens=4, ignore_eos=True), [EOS] * 4)
    assert req.output_token_ids == [EOS] * 4 and req.finish_reason == FinishReason.LENGTH


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    req = run_to_end(make("a", 3, ignore_eos=True, stop_token_ids=[9]), [5, 9, 6])
    assert req.output_token_ids == [5, 9] and req.status == RequestStatus.FINISHED_STOPPED


def test_max_tokens_and_stop_on_the_same_token_is_a_stop() -> None:
    assert run_to_end(make("a", 3, max_tokens=2), [5, 6]).finish_reason == FinishReason.LENGTH
    assert run_to_end(make("b", 3, max_tokens=2), [5, EOS]).finish_reason == FinishReason.STOP


def test_max_model_len_ends_the_sequence() -> None:
    req = run_to_end(make("a", 10, max_tokens=100), [5] * 100, max_len=13)
    assert req.num_tokens == 13 and req.output_token_ids == [5, 5, 5] and req.finish_reason == FinishReason.LENGTH


# ---------------------------------------------------------------------------------- finish / abort


def test_abort_frees_blocks_for_running_and_waiting_requests() -> None:
    sched = make_sched(max_seqs=1)
    sched.add_request(make("a", 9))
    sched.add_request(make("w", 3))
    step(sched)
    assert sched.kv.get_block_ids("a")[0] == [0, 1, 2] and sched.kv.num_free_blocks == 13
    assert sched.abort_request("a") is True
    assert sched.kv.num_free_blocks == 16 and sched.num_running == 0
    assert sched.abort_request("w") is True and sched.num_waiting == 0
    assert sched.abort_request("a") is False and sched.abort_request("nope") is False
    out = sched.schedule()
    assert out.finished_ids == ["a", "w"] and out.is_empty
    sched.check_invariants()


def test_finish_request_for_a_stop_string() -> None:
    sched = make_sched()
    req = make("a", 3)
    sched.add_request(req)
    out = sched.schedule()
    assert sched.finish_request("a", FinishReason.STOP)  # engine saw a stop string meanwhile
    assert sched.update_from_output(out, {"a": [5]}) == []  # late tokens for it are dropped
    assert (req.status, req.finish_reason) == (RequestStatus.FINISHED_STOPPED, FinishReason.STOP)
    assert sched.kv.num_free_blocks == 16 and not sched.has_unfinished()
    assert sched.finish_request("a", FinishReason.STOP) is False


# ---------------------------------------------------------------------------------- n > 1


def test_a_child_waits_for_its_parent_prompt_then_hits_its_blocks() -> None:
    sched = make_sched()
    prompt = list(range(300, 309))  # 9 tokens: two full blocks
    child = Request("p-1", prompt, SamplingParams(max_tokens=2), parent_id="p")
    other = make("x", 2, max_tokens=2, base=900)
    parent = Request("p", prompt, SamplingParams(max_tokens=5))
    for r in (child, other, parent):  # the child is queued before its parent
        sched.add_request(r)
    out, _ = step(sched)
    assert chunks(out) == {"x": 2, "p": 9}  # the child waits; the one behind it does not
    assert list(sched.waiting) == [child]
    out, _ = step(sched)
    c = out.scheduled[-1]
    assert (c.request_id, c.start_pos, c.num_tokens) == ("p-1", 8, 1)
    assert c.block_ids[0][:2] == sched.kv.get_block_ids("p")[0][:2] == [1, 2]
    assert child.num_cached_tokens == 8 and sched.prefix_hit_rate == pytest.approx(8 / 20)


# ---------------------------------------------------------------------------------- validation


def test_bad_prompts_are_value_errors_naming_the_numbers() -> None:
    sched = make_sched(max_len=16, num_blocks=3)
    with pytest.raises(ValueError, match="prompt has 16 tokens; max_model_len is 16"):
        sched.add_request(make("a", 16))
    with pytest.raises(ValueError, match="prompt has 13 tokens and needs 4 KV blocks .* only 3 blocks"):
        sched.add_request(make("b", 13))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make("c", []))
    sched.add_request(make("d", 12))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make("d", 3))
    assert sched.num_waiting == 1


# ---------------------------------------------------------------------------------- simulation


def fake_model(request_id: str, tokens: list[int]) -> int:
    """A deterministic "model": the next token depends on every token before it (and on the
    request, as sampling would), so a step that read wrong KV would change the output."""
    return zlib.crc32(repr((request_id, tokens)).encode()) % 16


class FakeRunner:
    """Keeps "KV" as the token id stored in each slot, and checks that every scheduled request
    sees exactly its own tokens through its block table (prefix hits, chunks and recompute
    included). Requests are run in list order, as the runner contract says."""

    def __init__(self, num_blocks: int) -> None:
        self.slots: list[list[int | None]] = [[None] * BS for _ in range(num_blocks)]

    def execute(self, out: SchedulerOutput, sched: Scheduler) -> dict[str, list[int]]:
        sampled: dict[str, list[int]] = {}
        for s in out.scheduled:
            req = sched.get_request(s.request_id)
            assert req is not None
            end = s.start_pos + s.num_tokens
            assert len(s.block_ids[0]) * BS >= end and len(s.block_ids[0]) <= sched.kv.num_blocks
            for p, tok in enumerate(s.token_ids, start=s.start_pos):
                self.slots[s.block_ids[0][p // BS]][p % BS] = tok
            seen = [self.slots[s.block_ids[0][p // BS]][p % BS] for p in range(end)]
            assert seen == req.all_token_ids[:end], f"{s.request_id} would attend to wrong KV"
            assert s.sample == (end == req.num_tokens)
            if s.sample:
                sampled[s.request_id] = [fake_model(s.request_id, seen)]  # type: ignore[arg-type]
        return sampled


def reference_output(req: Request, max_seq_len: int) -> tuple[list[int], FinishReason]:
    """What the request must generate, computed one sequence at a time without any scheduler."""
    p, out = req.sampling_params, list[int]()
    while True:
        tok = fake_model(req.request_id, req.prompt_token_ids + out)
        out.append(tok)
        if len(out) > p.min_tokens and ((tok == EOS and not p.ignore_eos) or tok in p.stop_token_ids):
            return out, FinishReason.STOP
        if len(out) >= p.max_tokens or len(req.prompt_token_ids) + len(out) >= max_seq_len:
            return out, FinishReason.LENGTH


def random_workload(rng: random.Random, n: int) -> list[Request]:
    prefixes = [[rng.randrange(16, 100) for _ in range(rng.randint(4, 14))] for _ in range(3)]
    reqs: list[Request] = []
    while len(reqs) < n:
        prompt = (rng.choice(prefixes) if rng.random() < 0.6 else []) + [
            rng.randrange(16, 100) for _ in range(rng.randint(1, 12))]
        max_tokens = rng.randint(1, 20)
        params = SamplingParams(max_tokens=max_tokens, min_tokens=rng.choice([0, 0, min(3, max_tokens)]),
                                ignore_eos=rng.random() < 0.2, stop_token_ids=rng.choice([[], [11]]))
        rid = f"r{len(reqs)}"
        reqs.append(Request(rid, prompt, params, eos_token_ids=frozenset({EOS})))
        if rng.random() < 0.15:  # n = 2: a sibling sharing the prompt
            reqs.append(Request(f"{rid}-1", list(prompt), SamplingParams(max_tokens=max_tokens),
                                eos_token_ids=frozenset({EOS}), parent_id=rid))
    return reqs


@pytest.mark.parametrize("chunked,caching,num_blocks,budget", [
    (True, True, 8, 8), (True, False, 8, 8), (False, True, 12, 48), (False, False, 12, 48)])
@pytest.mark.parametrize("seed", [0, 1])
def test_randomized_workload_runs_to_completion_with_invariants_every_step(
        chunked: bool, caching: bool, num_blocks: int, budget: int, seed: int) -> None:
    rng = random.Random(seed)
    sched = make_sched(budget=budget, max_seqs=6, max_len=48, chunked=chunked, num_blocks=num_blocks, caching=caching)
    runner = FakeRunner(num_blocks)
    reqs = random_workload(rng, 50)
    pending = list(reqs)
    ended_early: set[str] = set()
    for _ in range(5000):
        for _ in range(rng.randint(0, 3)):
            if pending:
                sched.add_request(pending.pop(0))
        if not pending and not sched.has_unfinished():
            break
        if rng.random() < 0.03 and sched.num_running:  # a client leaves / a stop string is seen
            victim = rng.choice(sched.running).request_id
            ended_early.add(victim)
            if rng.random() < 0.5:
                assert sched.abort_request(victim)
            else:
                assert sched.finish_request(victim, FinishReason.STOP)
        was_running = {r.request_id for r in sched.running}
        out = sched.schedule()
        assert out.num_batched_tokens == sum(s.num_tokens for s in out.scheduled) <= budget
        if out.preempted_ids:  # a step that preempts admits nobody (it would only thrash)
            assert {s.request_id for s in out.scheduled} <= was_running - set(out.preempted_ids)
        sched.check_invariants()
        sched.update_from_output(out, runner.execute(out, sched))
        sched.check_invariants()
    else:
        pytest.fail("the workload did not finish")
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks) and sched.kv_usage == 0.0
    assert sched.kv.num_free_blocks == num_blocks
    assert sched.num_preemptions > 0, "the pool should be small enough to force preemption"
    for req in reqs:
        assert req.is_finished(), req.request_id
        expected, reason = reference_output(req, sched.max_seq_len)
        if req.request_id in ended_early:
            assert req.output_token_ids == expected[:req.num_output_tokens]
        else:
            assert (req.output_token_ids, req.finish_reason) == (expected, reason), req.request_id
    if caching:
        assert sched.prefix_hit_rate > 0
