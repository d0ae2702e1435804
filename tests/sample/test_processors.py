"""Logit processors: exact masks on crafted logits, penalties against HF / a hand computation."""

from __future__ import annotations

import pytest
import torch

from brisk.request import SamplingParams
from brisk.sample import processors as P
from brisk.sample.sampler import SamplingBatch, penalise

INF = float("inf")


def kept(logits: torch.Tensor) -> list[list[bool]]:
    return (~torch.isinf(logits)).tolist()


def test_padded_ids_counts_and_mask_drop_the_padding() -> None:
    ids = P.padded_ids([[7, 3, 7], [2], [], [9, 99]], 10, torch.device("cpu"))
    assert ids.tolist() == [[7, 3, 7], [2, 10, 10], [10, 10, 10], [9, 10, 10]]  # 99 is outside the vocab
    counts = P.token_counts(ids, 10)
    assert counts.shape == (4, 10)
    assert counts[0].tolist() == [0, 0, 0, 1, 0, 0, 0, 2, 0, 0]
    assert counts[1].tolist() == [0, 0, 1, 0, 0, 0, 0, 0, 0, 0]
    assert counts[2].sum() == 0 and counts[3].tolist() == [0] * 9 + [1]
    assert P.token_mask(ids, 10).tolist() == (counts > 0).tolist()


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3).log()
    out = P.apply_min_p(logits, torch.tensor([0.2, 0.0, 0.4]))  # thresholds 0.1, 0, 0.2
    assert kept(out) == [[True, True, True, False], [True, True, True, True], [True, True, False, False]]
    assert torch.equal(out[1], logits[1])  # 0 = off: untouched


def test_top_k_keeps_exactly_k_per_row() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0], [0.0, -INF, 5.0, -INF]])
    out = P.apply_top_k(logits, torch.tensor([2, 0, 1, 3]), 3)
    assert kept(out) == [[False, True, True, False], [True] * 4, [False, False, False, True], [True, False, True, False]]
    assert torch.equal(out[1], logits[1])  # 0 = off
    ties = P.apply_top_k(torch.tensor([[1.0, 2.0, 2.0, 0.0]]), torch.tensor([1]), 1)
    assert kept(ties) == [[False, True, True, False]]  # ties with the k-th are kept
    assert kept(P.apply_top_k(logits[:1], torch.tensor([10]), 10)) == [[True] * 4]  # k > vocab: all


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert kept(P.apply_top_p(logits, torch.tensor([0.8]))) == [[True, True, False, False]]  # 0.5 + 0.3 reaches 0.8
    assert kept(P.apply_top_p(logits, torch.tensor([0.81]))) == [[True, True, True, False]]
    assert kept(P.apply_top_p(logits, torch.tensor([0.01]))) == [[True, False, False, False]]  # the top token stays
    shuffled = torch.tensor([[0.15, 0.05, 0.5, 0.3]]).log()
    assert kept(P.apply_top_p(shuffled, torch.tensor([0.8]))) == [[False, False, True, True]]


def test_top_p_of_one_keeps_a_tail_that_rounding_would_drop() -> None:
    logits = torch.tensor([[0.0] + [-40.0] * 7])  # the tail is ~4e-18 each: the cumsum is 1.0 after the top
    assert kept(P.apply_top_p(logits, torch.tensor([1.0]))) == [[True] * 8]
    assert kept(P.apply_top_p(logits, torch.tensor([0.999]))) == [[True] + [False] * 7]


def test_combined_min_p_top_k_top_p_masks() -> None:
    probs = torch.tensor([[0.05, 0.4, 0.02, 0.25, 0.15, 0.08, 0.05]])
    logits = probs.log()
    out = P.apply_min_p(logits, torch.tensor([0.1]))  # < 0.04 goes: token 2
    out = P.apply_top_k(out, torch.tensor([5]), 5)  # keeps 1, 3, 4, 5 and the tied 0.05s (0 and 6)
    assert kept(out) == [[True, True, False, True, True, True, True]]
    out = P.apply_top_p(out, torch.tensor([0.75]))  # renormalised over 0.98: .4/.98 + .25/.98 < .75 <= + .15/.98
    assert kept(out) == [[False, True, False, True, True, False, False]]


def test_logit_bias_adds_per_row_and_bans_win() -> None:
    logits = torch.zeros(2, 5)
    params = [SamplingParams(logit_bias={1: 2.5, 4: -100.0}), SamplingParams()]
    out = penalise(logits, SamplingBatch(params, [None, None], banned_token_ids=[[4], [0, 7]]))
    assert out.tolist() == [[0, 2.5, 0, 0, -INF], [-INF, 0, 0, 0, 0]]  # ban beyond vocab (7) is ignored
    assert logits.eq(0).all()  # the input is never modified
    out = penalise(logits, SamplingBatch([SamplingParams(logit_bias={1: -100.0})] * 2, [None, None]))
    assert out.tolist() == [[0, -100, 0, 0, 0]] * 2


def test_repetition_penalty_equals_hf_transformers() -> None:
    hf = pytest.importorskip("transformers.generation.logits_process")
    gen = torch.Generator().manual_seed(0)
    vocab = 300
    logits = torch.randn(4, vocab, generator=gen) * 4
    penalties = [1.3, 1.0, 0.7, 2.0]
    prompts = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (20, 5, 0, 40)]
    outputs = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (10, 3, 7, 0)]
    batch = SamplingBatch([SamplingParams(repetition_penalty=r) for r in penalties], [None] * 4,
                          output_token_ids=outputs, prompt_token_ids=prompts)
    ours = penalise(logits, batch)
    for row, pen in enumerate(penalties):
        ids = torch.tensor([prompts[row] + outputs[row]], dtype=torch.int64)
        ref = hf.RepetitionPenaltyLogitsProcessor(pen)(ids, logits[row:row + 1].clone())
        assert torch.equal(ours[row], ref[0]), row
    assert torch.equal(ours[1], logits[1])  # 1.0 = off, bit for bit
    seen = set(prompts[0] + outputs[0])
    assert all(ours[0, t] < logits[0, t] for t in seen if logits[0, t] != 0)  # > 1 always lowers


def test_frequency_and_presence_penalties_match_a_hand_computation() -> None:
    logits = torch.tensor([[1.0, 2.0, -0.5, 0.25, 3.0], [1.0, 2.0, -0.5, 0.25, 3.0]])
    outputs = [[1, 1, 1, 3, 4], [0, 0]]
    prompts = [[2, 2, 2], [4]]  # the prompt does not count for these penalties
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams(frequency_penalty=-1.0, presence_penalty=1.5)]
    out = penalise(logits, SamplingBatch(params, [None] * 2, output_token_ids=outputs, prompt_token_ids=prompts))
    expected = []
    for row, p in enumerate(params):
        r = logits[row].tolist()
        for t in range(5):
            c = outputs[row].count(t)
            r[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
        expected.append(r)
    assert out.tolist() == expected
    assert expected[0] == [1.0, 2.0 - 1.75, -0.5, 0.25 - 0.75, 3.0 - 0.75]


def test_penalties_apply_in_order_bias_bans_repetition_frequency() -> None:
    logits = torch.tensor([[2.0, -2.0, 4.0, 1.0]])
    p = SamplingParams(logit_bias={0: 2.0, 1: 1.0}, repetition_penalty=2.0, frequency_penalty=0.5)
    batch = SamplingBatch([p], [None], output_token_ids=[[0, 0, 1]], prompt_token_ids=[[2]], banned_token_ids=[[3]])
    # token 0: (2 + 2) / 2 - 0.5 * 2 = 1; token 1: (-2 + 1) * 2 - 0.5 = -2.5; token 2: 4 / 2; token 3: banned
    assert penalise(logits, batch).tolist() == [[1.0, -2.5, 2.0, -INF]]
