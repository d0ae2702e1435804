"""SamplingParams validation: every field rejects bad values with a message naming it."""

from __future__ import annotations

import math

import pytest

from brisk.errors import InvalidRequest
from brisk.request import SamplingParams


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"stop": [""]}, "stop"),
    ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
    ({"min_p": 1.01}, r"min_p must be in \[0, 1\]"),
    ({"min_p": float("nan")}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"repetition_penalty": -1.0}, "repetition_penalty must be > 0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"logit_bias": [1, 2]}, "logit_bias must be a mapping"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be non-negative integer token ids, got -1"),
    ({"logit_bias": {"a": 1.0}}, "logit_bias keys"),
    ({"logit_bias": {5: 100.5}}, r"logit_bias values must be in \[-100, 100\], got 100.5 for token 5"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias values"),
    ({"logprobs": -1}, r"logprobs must be None \(off\) or an integer in \[0, 20\], got -1"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": 1.5}, "logprobs"),
    ({"prompt_logprobs": 21}, r"prompt_logprobs must be None \(off\) or an integer in \[0, 20\]"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ({"n": 0}, "n must be an integer >= 1, got 0"),
    ({"n": 2.0}, "n must be an integer"),
])
def test_invalid_sampling_values_are_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_defaults_and_edges_are_accepted() -> None:
    p = SamplingParams()
    assert (p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (0.0, 1.0, 0.0, 0.0)
    assert (p.logit_bias, p.logprobs, p.prompt_logprobs, p.n) == (None, None, None, 1)
    SamplingParams(min_p=1.0, repetition_penalty=0.01, presence_penalty=-2, frequency_penalty=2, logprobs=0,
                   prompt_logprobs=20, n=8, logit_bias={0: -100, 3: 100.0})


def test_logit_bias_accepts_json_string_keys() -> None:
    assert SamplingParams(logit_bias={"15": 2.0, 7: -1.0}).logit_bias == {15: 2.0, 7: -1.0}


def test_check_vocab_names_the_bad_id() -> None:
    p = SamplingParams(logit_bias={3: 1.0, 50000: -5.0})
    p.check_vocab(50001)
    with pytest.raises(ValueError, match=r"logit_bias names token id 50000, outside the vocabulary \(0..49999\)"):
        p.check_vocab(50000)
    SamplingParams().check_vocab(1)


def test_stop_accepts_a_single_string() -> None:
    assert SamplingParams(stop="END").stop == ["END"]
    assert math.isclose(SamplingParams(top_k=-1).top_k, 0)


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_k": 1.5}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"max_tokens": True}, "max_tokens"),
    ({"logit_bias": {5: 500}}, "logit_bias"),
    ({"n": 0}, "n"),
])
def test_errors_name_their_field(kwargs: dict, param: str) -> None:
    """The server answers 400 with `param` taken from the error: each check names its field."""
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_check_vocab_covers_stop_token_ids_of_any_size() -> None:
    p = SamplingParams(stop_token_ids=[2, 2**64])
    with pytest.raises(InvalidRequest, match=r"stop_token_ids names token id 18446744073709551616") as info:
        p.check_vocab(49152)
    assert info.value.param == "stop_token_ids"


def test_top_k_past_the_vocabulary_keeps_every_token() -> None:
    """top_k is unbounded (vLLM's contract); the sampler clamps it to the vocabulary, so 2**64
    neither overflows a tensor nor changes the distribution."""
    import torch

    from brisk.sample.sampler import SamplingBatch, sample

    logits = torch.randn(2, 50)
    params = [SamplingParams(temperature=1.0, top_k=2**64, seed=1), SamplingParams(temperature=1.0, seed=1)]
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)]
    out = sample(torch.stack([logits[0], logits[0]]), SamplingBatch(params, gens))
    assert out.token_ids[0] == out.token_ids[1]
