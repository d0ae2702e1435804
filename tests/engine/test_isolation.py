"""A request whose parameters break its batch step ends alone: its neighbours keep exactly the
tokens they get without it, and its KV blocks go back to the pool.

The poison is planted after admission (admission refuses it), standing for any parameter a
future check might miss.
"""

from __future__ import annotations

from typing import Any

import pytest

from brisk import LLM, SamplingParams
from brisk.errors import InvalidRequest

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)
PROMPT = "one two three four five six seven eight one two three four five six seven eight one two"


@pytest.fixture(scope="module", params=[None, {"method": "ngram", "num_speculative_tokens": 4}],
                ids=["plain", "ngram"])
def llm(request: pytest.FixtureRequest, brisk_llm: LLM) -> LLM:
    return brisk_llm.with_speculation(request.param)


def _alone(llm: LLM, params: SamplingParams) -> list[int]:
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids


class _Poisoned(SamplingParams):
    """Valid when admitted; from the first step on, a stop token id that would overflow an int64
    tensor in the sampler."""

    admitted = False

    def check_vocab(self, vocab_size: int) -> None:
        super().check_vocab(vocab_size)
        if not self.admitted:
            self.admitted = True
            self.stop_token_ids = [2**64]


def _poisoned() -> SamplingParams:
    return _Poisoned(max_tokens=16, temperature=0.8, seed=3, min_tokens=4)


def _run(llm: LLM, requests: dict[str, SamplingParams]) -> tuple[dict[str, list[int]], dict[str, Any]]:
    engine = llm.engine
    ids = llm.tokenizer.encode(PROMPT)
    for rid, params in requests.items():
        engine.add_request(rid, ids, params)
    finished: dict[str, list[int]] = {}
    failures: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        failures.update(engine.take_failures())
    return finished, failures


def test_the_culprit_fails_alone_and_its_neighbours_keep_their_tokens(llm: LLM) -> None:
    greedy, seeded = _alone(llm, GREEDY), _alone(llm, SEEDED)
    finished, failures = _run(llm, {"greedy": GREEDY, "poison": _poisoned(), "seeded": SEEDED})
    assert finished == {"greedy": greedy, "seeded": seeded}
    assert list(failures) == ["poison"] and isinstance(failures["poison"], InvalidRequest)
    assert "stop_token_ids" in str(failures["poison"])
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.num_blocks


def test_generate_raises_for_the_culprit_and_leaves_the_engine_clean(llm: LLM) -> None:
    with pytest.raises(RuntimeError, match="generation failed: stop_token_ids names token id"):
        llm.generate([PROMPT, PROMPT], [GREEDY, _poisoned()], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.num_blocks
    assert _alone(llm, GREEDY) == _alone(llm, GREEDY)  # and it still serves
