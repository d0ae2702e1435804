"""Tokenizer.token_bytes: each token's raw bytes, joined, give back the text's UTF-8 exactly, even
where a token holds only part of a character (what the chat API's logprobs `bytes` carry)."""

from __future__ import annotations

import pytest

TEXTS = ["Hello world", "café crème", "😀 emoji and 漢字", "tabs\tand\nnewlines  "]


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_join_to_the_text(brisk_llm, text: str) -> None:
    tok = brisk_llm.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


def test_special_tokens_are_their_spelling(brisk_llm) -> None:
    tok = brisk_llm.tokenizer
    eos = tok.token_to_id("<|im_end|>")
    assert tok.token_bytes(eos) == b"<|im_end|>"
