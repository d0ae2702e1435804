"""The verifier on hand-made logits: greedy prefix rule, and exact rejection sampling."""

from __future__ import annotations

import math

import torch

from brisk.request import Request, SamplingParams
from brisk.speculative.base import Draft
from brisk.speculative.verify import verify

V = 8


def _req(**params: object) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(max_tokens=50, **params), eos_token_ids=frozenset({0}))


def _onehot_rows(tokens: list[int]) -> torch.Tensor:
    rows = torch.full((len(tokens), V), -5.0)
    rows[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return rows


def test_greedy_keeps_the_matching_prefix_and_adds_the_target_token() -> None:
    logits = _onehot_rows([4, 5, 6, 7])  # the target says 4, 5, 6, then the bonus 7
    (out,) = verify([logits], [_req(temperature=0)], [Draft([4, 5, 1])], [None])
    assert (out.token_ids, out.num_accepted) == ([4, 5, 6], 2)
    (out,) = verify([logits], [_req(temperature=0)], [Draft([4, 5, 6])], [None])
    assert (out.token_ids, out.num_accepted) == ([4, 5, 6, 7], 3)
    (out,) = verify([logits], [_req(temperature=0)], [Draft([3, 5, 6])], [None])
    assert (out.token_ids, out.num_accepted) == ([4], 0)


def test_greedy_rows_see_earlier_drafts_as_emitted() -> None:
    """min_tokens bans EOS only while fewer than min_tokens outputs exist, counting drafts before
    the row; a repetition penalty counts them too."""
    logits = _onehot_rows([0, 0, 0])  # the model wants EOS everywhere
    logits[:, 3] = 4.0  # and 3 as runner-up
    req = _req(temperature=0, min_tokens=2)
    req.output_token_ids = [5]  # one output so far: row 0 (2nd output) is banned EOS, row 1 is not
    (out,) = verify([logits], [req], [Draft([3, 3])], [None])
    assert out.token_ids == [3, 0]


def _chi2_pvalue_ok(counts: torch.Tensor, probs: torch.Tensor, n: int) -> bool:
    """Pearson chi-square on cells with expected >= 5 against the 99.9% critical value."""
    expected = probs * n
    keep = expected >= 5
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty approximation of the chi-square 0.999 quantile
    z = 3.09
    critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat < critical


def test_rejection_sampling_reproduces_the_target_whatever_the_draft() -> None:
    gen = torch.Generator().manual_seed(0)
    p_logits = torch.randn(2, V, generator=gen) * 1.5  # target rows for t_last and after d1
    bad_q = torch.softmax(-p_logits[0] * 2, dim=-1)  # a draft that prefers what the target does not
    req = _req(temperature=1.0)
    n = 20000
    first = torch.zeros(V)
    for i in range(n):
        d = int(torch.multinomial(bad_q, 1, generator=gen))
        (out,) = verify([p_logits], [req], [Draft([d], bad_q.unsqueeze(0))], [gen])
        first[out.token_ids[0]] += 1
    assert _chi2_pvalue_ok(first, torch.softmax(p_logits[0], -1), n)


def test_point_mass_drafts_and_top_k_temperature_keep_the_target_distribution() -> None:
    gen = torch.Generator().manual_seed(1)
    p_logits = torch.randn(2, V, generator=gen)
    params = {"temperature": 0.7, "top_k": 5}
    req = _req(**params)
    target = p_logits[0] / 0.7
    target[target < target.topk(5).values[-1]] = -math.inf
    target = torch.softmax(target, -1)
    n = 20000
    first = torch.zeros(V)
    for i in range(n):
        d = i % V  # every token drafted in turn, even ones top-k excludes
        (out,) = verify([p_logits], [req], [Draft([d])], [gen])
        first[out.token_ids[0]] += 1
    assert first[target == 0].sum() == 0
    assert _chi2_pvalue_ok(first, target, n)


def test_seeded_verification_is_reproducible() -> None:
    p_logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    outs = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(42)
        outs.append([verify([p_logits], [_req(temperature=1.0)], [Draft([1, 2, 3])], [gen])[0].token_ids
                     for _ in range(20)])
    assert outs[0] == outs[1]
