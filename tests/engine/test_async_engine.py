"""AsyncEngine: the engine thread serves asyncio callers, survives a failing step, refuses bad
input without queuing it, and hands every block back."""

from __future__ import annotations

import asyncio

import pytest

from brisk.engine.async_engine import AsyncEngine, EngineOverloaded
from brisk.engine.llm import LLM
from brisk.request import SamplingParams


async def _final(q: asyncio.Queue) -> object:
    while True:
        item = await q.get()
        if isinstance(item, BaseException) or item.finished:
            return item


def test_async_engine_outputs_errors_and_bad_input(brisk_llm: LLM) -> None:
    eng = brisk_llm.engine
    runner = eng.runner
    real_execute = runner.execute
    calls = {"n": 0}

    def flaky(*args, **kwargs):  # the second step of the engine's life raises
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated kernel failure")
        return real_execute(*args, **kwargs)

    async def main() -> None:
        ae = AsyncEngine(eng, max_waiting=4)
        ae.start()
        try:
            ids = brisk_llm.tokenizer.encode("The sky is")
            greedy = SamplingParams(max_tokens=4, temperature=0.0)
            with pytest.raises(ValueError, match="outside the vocabulary"):
                await ae.add([10**9], greedy)
            runner.execute = flaky
            _, q1 = await ae.add(ids, greedy)
            failed = await _final(q1)
            assert isinstance(failed, RuntimeError) and "simulated" in str(failed)
            runner.execute = real_execute
            _, q2 = await ae.add(ids, greedy)  # the loop went on after the failure
            out = await _final(q2)
            assert len(out.outputs[0].token_ids) == 4
            ae.max_waiting = 0
            with pytest.raises(EngineOverloaded):
                await ae.add(ids, greedy)
        finally:
            runner.execute = real_execute
            ae.shutdown()
        assert not ae.alive

    asyncio.run(main())
    assert not eng.has_unfinished_requests() and eng.scheduler.kv.num_free_blocks == eng.num_blocks


def test_a_request_that_breaks_its_step_fails_alone(brisk_llm: LLM) -> None:
    """The culprit's queue gets the error; a request in the same steps finishes with its tokens."""
    from tests.engine.test_isolation import GREEDY, PROMPT, _poisoned

    eng = brisk_llm.engine
    ids = brisk_llm.tokenizer.encode(PROMPT)
    alone = brisk_llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids

    async def main() -> None:
        ae = AsyncEngine(eng)
        ae.start()
        try:
            _, good = await ae.add(ids, GREEDY)
            _, bad = await ae.add(ids, _poisoned())
            failed, out = await _final(bad), await _final(good)
            assert isinstance(failed, RuntimeError) and "generation failed: stop_token_ids" in str(failed)
            assert out.outputs[0].token_ids == alone
        finally:
            ae.shutdown()

    asyncio.run(main())
    assert not eng.has_unfinished_requests() and eng.scheduler.kv.num_free_blocks == eng.num_blocks
