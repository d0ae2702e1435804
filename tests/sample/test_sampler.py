"""Sampler: exact masks on crafted logits, per-row seeds, and the sampled distribution."""

from __future__ import annotations

import math

import pytest
import torch

from brisk.request import SamplingParams
from brisk.sample.sampler import _apply_top_k, _apply_top_p, sample


def test_greedy_takes_argmax_per_row() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, -1.0, 4.9]])
    assert sample(logits, [SamplingParams(temperature=0)] * 2, [None, None]) == [1, 0]


def test_top_k_keeps_exactly_k_per_row() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [4.0, 3.0, 2.0, 1.0]])
    out = _apply_top_k(logits, torch.tensor([2, 0]))
    assert torch.isinf(out[0]).tolist() == [True, False, False, True]
    assert not torch.isinf(out[1]).any()  # 0 = off


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = ~torch.isinf(_apply_top_p(logits, torch.tensor([0.8])))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 + 0.3 reaches 0.8
    kept = ~torch.isinf(_apply_top_p(logits, torch.tensor([0.81])))
    assert kept.tolist() == [[True, True, True, False]]
    kept = ~torch.isinf(_apply_top_p(logits, torch.tensor([0.01])))
    assert kept.tolist() == [[True, False, False, False]]  # the top token always stays


def test_banned_tokens_are_never_sampled() -> None:
    logits = torch.tensor([[10.0, 0.0, 0.0]])
    assert sample(logits, [SamplingParams(temperature=0)], [None], [[0]]) != [0]


def test_seeded_rows_do_not_depend_on_their_neighbours() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20)
    in_batch_gens = [torch.Generator().manual_seed(s) for s in (1, 42, 2)]
    alone_gen = torch.Generator().manual_seed(42)
    in_batch = [sample(logits, [p] * 3, in_batch_gens)[1] for _ in range(20)]
    alone = [sample(logits[1:2], [p], [alone_gen])[0] for _ in range(20)]
    assert in_batch == alone
    assert len(set(alone)) > 1  # it really sampled


def test_sampled_frequencies_follow_softmax_with_temperature() -> None:
    """Chi-square goodness of fit with a fixed seed (p > 0.001 at 4 degrees of freedom: chi2 < 18.5)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = SamplingParams(temperature=0.7, seed=3)
    gen = torch.Generator().manual_seed(3)
    n = 20000
    counts = torch.zeros(5)
    for _ in range(n):
        counts[sample(logits, [p], [gen])[0]] += 1
    expected = torch.softmax(logits[0] / 0.7, -1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.5, chi2


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"stop": [""]}, "stop"),
])
def test_invalid_sampling_values_are_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string() -> None:
    assert SamplingParams(stop="END").stop == ["END"]
    assert math.isclose(SamplingParams(top_k=-1).top_k, 0)
