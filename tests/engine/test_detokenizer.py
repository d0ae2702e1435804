"""Incremental detokenization: UTF-8 across token boundaries and stop strings across tokens."""

from __future__ import annotations

import pytest

from brisk.engine.detokenizer import IncrementalDetokenizer
from brisk.loader.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(gguf_path) -> Tokenizer:
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    return Tokenizer.from_gguf_metadata({k: f.contents() for k, f in reader.fields.items()})


TEXTS = ["héllo wörld 🙂 — 世界 👩‍👩‍👧 done", "plain ascii text, nothing special", "tabs\tand\n\nnewlines  🧪"]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_concatenate_to_the_full_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=[])
    pieces = []
    for t in ids:
        detok.push(t)
        pieces.append(detok.stream_delta(finished=False))
        assert "\ufffd" not in pieces[-1]  # never a half character
    detok.flush()
    pieces.append(detok.stream_delta(finished=True))
    assert "".join(pieces) == tokenizer.decode(ids) == text


def test_multibyte_character_split_over_tokens_waits_for_completion(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🧪", add_special_tokens=False)
    assert len(ids) > 1, "the emoji should span several byte-level tokens"
    detok = IncrementalDetokenizer(tokenizer, stop=[])
    for t in ids[:-1]:
        detok.push(t)
        assert detok.text == ""
    detok.push(ids[-1])
    assert detok.text == "🧪"


def test_stop_string_split_across_tokens_is_cut_and_never_streamed(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The answer is 42. END OF STORY and more", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["END OF STORY"])
    streamed = ""
    for t in ids:
        detok.push(t)
        streamed += detok.stream_delta(finished=False)
        if detok.stopped:
            break
    streamed += detok.stream_delta(finished=True)
    assert detok.stopped
    assert detok.text == streamed == "The answer is 42. "
    assert "END" not in streamed


def test_earliest_stop_string_wins(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("alpha beta gamma", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["gamma", "beta"])
    for t in ids:
        detok.push(t)
    assert detok.text == "alpha "


def test_trailing_partial_character_is_flushed_as_replacement(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 🧪", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=[])
    for t in ids[:-1]:
        detok.push(t)
    detok.flush()
    assert detok.text.startswith("ok") and detok.text.endswith("\ufffd")
