"""N-gram drafts by match length: each length keeps its own acceptance statistics, and a request
with nothing to match reserves no draft slots."""

from __future__ import annotations

from brisk.config import SpecConfig
from brisk.engine.speculative import Speculator
from brisk.request import Request, SamplingParams
from brisk.speculative.base import DraftRequest
from brisk.speculative.length import DraftLength
from brisk.speculative.ngram import NgramProposer, ngram_match

COSTS = [0.06 * k for k in range(8)]


def test_match_reports_its_length_and_the_tokens_that_followed() -> None:
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 8]
    assert ngram_match(tokens, 1, 4, 3) == (3, [9, 1, 6])  # "6 7 8" seen before, then 9 1 6
    assert ngram_match([1, 2, 3], 1, 4, 3) == (0, [])


def test_each_match_length_learns_its_own_draft_length() -> None:
    """Drafts after a 1-token match always fail, after a 4-token match always succeed: the same
    request drafts nothing after the one and the most after the other."""
    length = DraftLength(SpecConfig(method="ngram"), 0.0, COSTS, seed=0)
    for _ in range(60):
        length.observe("r", 3, 0, cls=1)
        length.observe("r", 7, 7, cls=4)
    # Thompson sampling still tries the poor class now and then (p1 ~ Beta(1, ~36): above the
    # 6% break-even about one draw in ten)
    assert [length.wanted("r", 1) for _ in range(40)].count(0) >= 30
    assert all(length.wanted("r", 4) == length.max_k for _ in range(20))
    # a new request starts from what the engine saw per class
    assert length.wanted("new", 4) == length.max_k


def test_no_match_reserves_no_slots_and_a_match_is_proposed_as_planned() -> None:
    proposer = NgramProposer(1, 4)
    spec = Speculator(SpecConfig(method="ngram", num_speculative_tokens=4), proposer, COSTS[:5])
    nothing = Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=8))
    copying = Request("b", [1, 2, 3, 9, 9, 1, 2], SamplingParams(max_tokens=8))
    wanted = spec.plan([nothing, copying])
    assert wanted["a"] == 0
    assert wanted["b"] == 4 and spec._classes["b"] == 2
    # fill proposes what followed the match ("1 2" before: "3 9 9 1"), cut to the slots given
    ask = DraftRequest("b", copying.all_token_ids, 3, [[]], copying.sampling_params, None)
    assert proposer.propose([ask])[0].token_ids == [3, 9, 9]
    spec.release("b", finished=True)
    assert "b" not in spec._classes


def test_always_accepted_drafts_grow_past_one_token() -> None:
    """A costly draft (0.45 of a step per token, like a GGUF copy of the target) whose drafts are
    all accepted: one-token drafts are no trial of the second, so the controller must still try
    longer ones and learn they pay (it used to stay at k = 1 with p2 at its prior)."""
    costs = [0.0, 0.1, 0.13, 0.19, 0.24, 0.29, 0.33, 0.38]
    length = DraftLength(SpecConfig(method="ngram"), 0.45, costs, seed=1)
    ks = []
    for _ in range(200):
        k = length.wanted("r")
        length.observe("r", k, k)
        ks.append(k)
    assert sum(ks[-50:]) / 50 > 5


def test_lookup_first_drafts_matches_and_hands_the_rest_to_the_method() -> None:
    """`lookup_first`: a request whose tail occurs earlier drafts the lookup's tokens (a free class),
    another one the wrapped method's (class 0, priced at the method's cost)."""
    from brisk.speculative.base import Draft, Proposer
    from brisk.speculative.ngram import LookupFirst

    class Model(Proposer):
        name, draft_cost, max_drafts = "model", 0.3, 2
        asked: list[str] = []

        def propose(self, requests: list[DraftRequest]) -> list[Draft]:
            self.asked += [r.request_id for r in requests]
            return [Draft([42] * r.num_drafts) for r in requests]

        def release(self, request_id: str) -> None:
            pass

    inner = Model()
    proposer = LookupFirst(inner, 1, 4)
    assert proposer.name == "model+lookup" and proposer.free_classes == frozenset({1, 2, 3, 4})
    spec = Speculator(SpecConfig(method="streaming", heads="x", num_speculative_tokens=4, lookup_first=True),
                      proposer, COSTS[:5])
    nothing = Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=8))
    copying = Request("b", [1, 2, 3, 9, 9, 1, 2], SamplingParams(max_tokens=8))
    wanted = spec.plan([nothing, copying])
    assert (wanted["a"], spec._classes["a"]) == (2, 0)  # the model's cap
    assert (wanted["b"], spec._classes["b"]) == (4, 2)
    asks = [DraftRequest("a", nothing.all_token_ids, 2, [[]], nothing.sampling_params, None),
            DraftRequest("b", copying.all_token_ids, 3, [[]], copying.sampling_params, None)]
    assert [d.token_ids for d in proposer.propose(asks)] == [[42, 42], [3, 9, 9]]
    assert inner.asked == ["a"]
    length = spec.length
    assert length is not None and length.cost(3, cls=2) == 1.0 + COSTS[3] < length.cost(3, cls=0)
    # under "auto", lookups of "b"'s match length stop landing: it drafts with the model instead of not at all
    spec = Speculator(SpecConfig(method="streaming", heads="x", lookup_first=True), proposer, COSTS[:8])
    assert spec.length is not None
    for _ in range(60):
        spec.length.observe("b", 4, 0, cls=2)
        spec.length.observe("b", 2, 2, cls=0)
    assert spec.plan([copying])["b"] == 2 and spec._classes["b"] == 0
    ask = DraftRequest("b", copying.all_token_ids, 2, [[]], copying.sampling_params, None)
    assert proposer.propose([ask])[0].token_ids == [42, 42]


def test_lookup_first_is_checked() -> None:
    import pytest

    with pytest.raises(ValueError, match="prompt lookup itself"):
        SpecConfig(method="ngram", lookup_first=True)
    with pytest.raises(ValueError, match='"lookup_first" is true or false'):
        SpecConfig(method="medusa", heads="h", lookup_first="yes")  # type: ignore[arg-type]


def test_the_length_is_chosen_within_what_the_source_can_draft() -> None:
    """A costly first verified row and long accepted runs: seven drafts pay, one does not. With
    only one draft to give (a short lookup continuation, a method of one stream), plain decoding
    is the better choice, not the best uncapped length cut to one."""
    length = DraftLength(SpecConfig(method="ngram"), 0.0, [0.0] + [0.9] * 7, seed=0)
    assert length.best_k(0.5, 0.95) == 7
    assert length.best_k(0.5, 0.95, cap=1) == 0
    assert length.best_k(0.5, 0.95, cap=3) == 3
