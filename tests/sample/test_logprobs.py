"""Logprobs: raw-model log_softmax values, exact ranks, top-N ordering; prompt logprobs."""

from __future__ import annotations

import pytest
import torch

from brisk.request import SamplingParams
from brisk.sample import logprobs as lp_module
from brisk.sample.logprobs import TokenLogprobs, prompt_logprobs, token_logprobs
from brisk.sample.sampler import SamplingBatch, sample


def test_token_logprobs_values_ranks_and_top_n() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.25, 4.0, -1.0]])
    out = token_logprobs(logits, torch.tensor([2, 3]), [3, 0])
    ref = logits.log_softmax(-1)
    assert out[0] == TokenLogprobs(2, ref[0, 2].item(), 2, ((1, ref[0, 1].item()), (2, ref[0, 2].item()),
                                                            (0, ref[0, 0].item())))
    assert out[1] == TokenLogprobs(3, ref[1, 3].item(), 4, ())  # 0: the chosen token only


def test_rank_counts_strictly_better_tokens() -> None:
    out = token_logprobs(torch.tensor([[2.0, 2.0, 1.0]]), torch.tensor([1]), [1])
    assert out[0].rank == 1  # tied with the best: still rank 1


def test_sampler_returns_raw_logprobs_not_the_processed_ones() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 64)
    params = [SamplingParams(temperature=0, logprobs=5, logit_bias={7: 30.0}),
              SamplingParams(temperature=0.5, top_k=3, logprobs=2, repetition_penalty=1.5),
              SamplingParams(temperature=0.7),  # no logprobs asked
              SamplingParams(temperature=2.0, logprobs=0, frequency_penalty=1.0)]
    batch = SamplingBatch(params, [None, torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(2)],
                          output_token_ids=[[], [1, 2], [], [3, 3]], prompt_token_ids=[[], [4], [], []])
    out = sample(logits, batch)
    raw = logits.log_softmax(-1)
    assert out.token_ids[0] == 7 and out.logprobs[2] is None
    for row in (0, 1, 3):
        got = out.logprobs[row]
        token = out.token_ids[row]
        assert got is not None and got.token_id == token
        assert got.logprob == raw[row, token].item()
        assert got.rank == int((raw[row] > raw[row, token]).sum()) + 1
        n = params[row].logprobs
        values, ids = raw[row].topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.int64))
        assert got.top == tuple(zip(ids.tolist(), values.tolist()))
        assert [v for _, v in got.top] == sorted((v for _, v in got.top), reverse=True)


def test_prompt_logprobs_per_position_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lp_module, "PROMPT_CHUNK", 3)
    torch.manual_seed(0)
    logits = torch.randn(8, 20)
    next_ids = [5, 1, 19, 0, 7, 7, 3, 12]
    out = prompt_logprobs(logits, next_ids, 2)
    raw = logits.log_softmax(-1)
    assert len(out) == 8
    for pos, got in enumerate(out):
        t = next_ids[pos]
        assert got.token_id == t and got.logprob == raw[pos, t].item()
        assert got.rank == int((raw[pos] > raw[pos, t]).sum()) + 1
        values, ids = raw[pos].topk(2)
        assert got.top == tuple(zip(ids.tolist(), values.tolist()))
    assert prompt_logprobs(torch.zeros(0, 20), [], 3) == []
