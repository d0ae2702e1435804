"""SamplingParams validation: every field rejects bad values with a message naming it."""

from __future__ import annotations

import math

import pytest

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
