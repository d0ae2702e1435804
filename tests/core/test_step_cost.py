"""The step cost model and the prompt cap it gives the scheduler under max_decode_slowdown."""

from __future__ import annotations

import pytest

from brisk.config import SchedulerConfig
from brisk.core.kv_cache_manager import KVCacheManager
from brisk.core.scheduler import Scheduler
from brisk.core.step_cost import StepCostModel
from brisk.request import Request, SamplingParams


def _true_time(decodes: int, prompt: int) -> float:
    return 0.02 + 0.004 * decodes + 0.003 * prompt  # a, b, c of a made-up machine


def test_fits_decode_line_and_per_prompt_token_cost() -> None:
    m = StepCostModel()
    assert m.decode_time(4) is None and m.prompt_token_cap(4, 2.0, 16) is None
    for i in range(60):
        d = 1 + i % 16
        m.observe(d, 0, _true_time(d, 0))
        m.observe(d, 64, _true_time(d, 64))
    assert m.decode_time(10) == pytest.approx(_true_time(10, 0), rel=1e-3)
    assert m.per_prompt_token == pytest.approx(0.003, rel=1e-3)
    # slowdown 2: the prompt tokens may add one decode-only step's time: (0.02 + 0.04) / 0.003 = 20
    assert m.prompt_token_cap(10, 2.0, 4) in (19, 20)  # fitted, so within a token
    assert m.prompt_token_cap(10, 1.05, 16) == 16  # never under the floor: prompts keep moving


def test_follows_a_machine_that_slows_down() -> None:
    m = StepCostModel()
    for _ in range(40):
        m.observe(8, 0, 0.05)
    for _ in range(80):
        m.observe(8, 0, 0.10)  # something else now shares the cores
    assert m.decode_time(8) == pytest.approx(0.10, rel=0.02)


def test_noise_and_tiny_chunks_do_not_move_the_prompt_cost() -> None:
    m = StepCostModel()
    m.observe(4, 0, 0.05)
    m.observe(4, 3, 0.2)  # under MIN_PROMPT_TOKENS
    m.observe(4, 32, 0.01)  # faster than decoding alone: noise
    assert m.per_prompt_token is None


def _req(rid: str, n: int, base: int) -> Request:
    return Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=64, ignore_eos=True),
                   eos_token_ids=frozenset({2}))


def test_scheduler_caps_prompt_chunks_beside_decodes() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=512, max_decode_slowdown=2.0)
    sched = Scheduler(cfg, KVCacheManager(256, 4, True))
    for i in range(4):
        sched.add_request(_req(f"d{i}", 5, 1000 + 10 * i))
    out = sched.schedule()  # no decodes running yet: the whole budget
    assert sum(s.num_tokens for s in out.scheduled) == 20
    sched.update_from_output(out, {s.request_id: [7] for s in out.scheduled})
    for _ in range(3):  # decode-only steps teach the model t(4)
        out = sched.schedule()
        sched.observe_step(out, _true_time(4, 0))
        sched.update_from_output(out, {s.request_id: [7] for s in out.scheduled})
    sched.add_request(_req("long", 300, 2000))
    out = sched.schedule()  # c still unknown: a floor-sized chunk (one block)
    assert {s.request_id: s.num_tokens for s in out.scheduled}["long"] == 4
    sched.observe_step(out, _true_time(4, 4))
    sched.update_from_output(out, {s.request_id: [7] for s in out.scheduled if s.sample})
    sched.step_cost.observe(4, 32, _true_time(4, 32))  # a bigger chunk's cost, as a later step would report
    out = sched.schedule()
    # c = 0.003, t(4) = 0.036 -> (2 - 1) * 0.036 / 0.003 = 12 prompt tokens beside the 4 decodes
    sizes = {s.request_id: s.num_tokens for s in out.scheduled}
    assert sizes.pop("long") in (11, 12) and sizes == {"d0": 1, "d1": 1, "d2": 1, "d3": 1}  # fitted: within a token
    sched.check_invariants()


def test_max_decode_slowdown_is_validated() -> None:
    with pytest.raises(ValueError, match="must be > 1"):
        SchedulerConfig(max_decode_slowdown=1.0)
    with pytest.raises(ValueError, match="needs chunked prefill"):
        SchedulerConfig(max_num_batched_tokens=4096, max_model_len=2048, enable_chunked_prefill=False,
                        max_decode_slowdown=1.5)
