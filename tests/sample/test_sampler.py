"""Sampler end to end: greedy paths, bans, per-row seeds, and the sampled distribution (chi-square)."""

from __future__ import annotations

import math

import pytest
import torch

from brisk.request import SamplingParams
from brisk.sample import processors, sampler
from brisk.sample.sampler import SamplerOutput, SamplingBatch, sample

GREEDY = SamplingParams(temperature=0)
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}  # chi-square, p = 0.001


def gens(*seeds: int | None) -> list[torch.Generator | None]:
    return [None if s is None else torch.Generator().manual_seed(s) for s in seeds]


def test_greedy_takes_argmax_per_row() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, -1.0, 4.9]])
    assert sample(logits, [GREEDY] * 2, [None, None]) == [1, 0]  # the list form
    out = sample(logits, SamplingBatch([GREEDY] * 2, [None, None]))
    assert out == SamplerOutput([1, 0], [None, None])


def test_all_greedy_batch_skips_every_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("a stage ran for an all-greedy batch without penalties")

    monkeypatch.setattr(processors, "padded", boom)
    monkeypatch.setattr(sampler, "_sample_rows", boom)
    monkeypatch.setattr(sampler, "token_logprobs", boom)
    logits = torch.randn(64, 1000)
    before = logits.clone()
    out = sample(logits, SamplingBatch([GREEDY] * 64, [None] * 64, output_token_ids=[[1, 2]] * 64))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert torch.equal(logits, before)


def test_greedy_rows_take_the_argmax_of_the_penalised_logits() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0], [3.0, 2.9, 0.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=1.2), SamplingParams(temperature=0, frequency_penalty=0.5),
              SamplingParams(temperature=0, logit_bias={2: 5.0})]
    out = sample(logits, SamplingBatch(params, [None] * 3, output_token_ids=[[0], [0], []], prompt_token_ids=[[], [], []]))
    assert out.token_ids == [1, 1, 2]


def test_banned_tokens_are_never_sampled() -> None:
    logits = torch.tensor([[10.0, 0.0, 0.0], [10.0, 9.0, 0.0]])
    assert sample(logits[:1], [GREEDY], [None], [[0]]) != [0]
    hot = SamplingParams(temperature=5.0)
    batch = SamplingBatch([hot, hot], gens(1, 2), banned_token_ids=[[0], [0, 1]])
    draws = [sample(logits, batch).token_ids for _ in range(200)]
    assert {d[0] for d in draws} == {1, 2} and {d[1] for d in draws} == {2}


def test_mixed_batch_greedy_rows_and_sampled_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 30)
    p = SamplingParams(temperature=1.0, top_k=5)
    batch = SamplingBatch([GREEDY, p, GREEDY, p], gens(None, 7, None, 8))
    for _ in range(20):
        out = sample(logits, batch).token_ids
        assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
        for row in (1, 3):
            assert out[row] in logits[row].topk(5).indices.tolist()


def test_seeded_rows_do_not_depend_on_their_neighbours_or_the_batch_size() -> None:
    torch.manual_seed(0)
    row = torch.randn(1, 50)
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, min_p=0.01, seed=42)
    alone_gen = torch.Generator().manual_seed(42)
    alone = [sample(row, SamplingBatch([p], [alone_gen])).token_ids[0] for _ in range(30)]
    assert len(set(alone)) > 1  # it really sampled
    neighbours = [GREEDY, SamplingParams(temperature=1.5, min_p=0.2), SamplingParams(top_k=3), SamplingParams(top_p=0.5)]
    for size, at in ((2, 0), (5, 3), (9, 8)):
        logits = torch.randn(size, 50)
        logits[at] = row[0]
        params = [neighbours[i % 4] for i in range(size)]
        params[at] = p
        generators = gens(*[(i if i % 2 else None) for i in range(size)])
        generators[at] = torch.Generator().manual_seed(42)
        batch = SamplingBatch(params, generators)
        assert [sample(logits, batch).token_ids[at] for _ in range(30)] == alone, size


def test_list_form_matches_the_batch_form() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 40)
    params = [SamplingParams(temperature=0.8, top_k=10), GREEDY, SamplingParams(top_p=0.7)]
    banned = [[1, 2], [], [3]]
    a = [sample(logits, params, g, banned) for g in [gens(5, None, 6)] for _ in range(10)]
    b = [sample(logits, SamplingBatch(params, g, banned_token_ids=banned)).token_ids for g in [gens(5, None, 6)]
         for _ in range(10)]
    assert a == b


def _truncated_softmax(logits: list[float], t: float, min_p: float, top_k: int, top_p: float) -> list[float]:
    """The target distribution, computed independently in float64: temperature, min-p, top-k, top-p, renormalise."""
    z = [x / t for x in logits]
    m = max(z)
    probs = [math.exp(x - m) for x in z]
    probs = [q / sum(probs) for q in probs]
    keep = [q >= min_p * max(probs) for q in probs]
    if top_k:
        kth = sorted(probs, reverse=True)[top_k - 1]
        keep = [k and q >= kth for k, q in zip(keep, probs)]
    mass = sum(q for k, q in zip(keep, probs) if k)
    order = sorted((i for i in range(len(probs)) if keep[i]), key=lambda i: -probs[i])
    before = 0.0
    for i in order:
        if before >= top_p:
            keep[i] = False
        before += probs[i] / mass
    kept = [q if k else 0.0 for k, q in zip(keep, probs)]
    return [q / sum(kept) for q in kept]


@pytest.mark.parametrize("t, min_p, top_k, top_p", [
    (0.7, 0.0, 0, 1.0),
    (0.8, 0.0, 5, 0.9),
    (1.3, 0.0, 6, 0.8),
    (0.6, 0.06, 0, 0.95),  # min-p after temperature: at T=1 the same min-p would keep 7 tokens, not 4
])
@pytest.mark.parametrize("seeded", [False, True])
def test_sampled_frequencies_follow_the_truncated_softmax(t: float, min_p: float, top_k: int, top_p: float,
                                                         seeded: bool) -> None:
    """Chi-square goodness of fit with fixed seeds; tokens outside the kept set must never appear."""
    logits = [2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -0.3, 0.2]
    target = _truncated_softmax(logits, t, min_p, top_k, top_p)
    n = 20000
    p = SamplingParams(temperature=t, min_p=min_p, top_k=top_k, top_p=top_p)
    torch.manual_seed(3)
    generators = gens(*range(n)) if seeded else [None] * n  # seeded: every row its own generator
    drawn = sample(torch.tensor([logits]).expand(n, -1), SamplingBatch([p] * n, generators)).token_ids
    counts = torch.bincount(torch.tensor(drawn), minlength=len(logits)).tolist()
    kept = [i for i, q in enumerate(target) if q > 0]
    assert all(counts[i] == 0 for i in range(len(logits)) if target[i] == 0), (counts, target)
    chi2 = sum((counts[i] - n * target[i]) ** 2 / (n * target[i]) for i in kept)
    assert chi2 < CHI2_999[len(kept) - 1], (chi2, counts, target)


def test_one_seeded_generator_over_many_steps_follows_the_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = SamplingParams(temperature=0.7, seed=3)
    batch = SamplingBatch([p], gens(3))
    n = 5000
    counts = torch.bincount(torch.tensor([sample(logits, batch).token_ids[0] for _ in range(n)]), minlength=5)
    expected = torch.softmax(logits[0] / 0.7, -1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_999[4], chi2


def test_bad_logit_bias_id_is_a_value_error_at_sampling_time() -> None:
    with pytest.raises(ValueError, match="token id 12"):
        sample(torch.zeros(1, 10), SamplingBatch([SamplingParams(logit_bias={3: 1.0, 12: 1.0})], [None]))
