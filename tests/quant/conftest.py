"""Shared pieces of the quantization tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from brisk.config import ModelConfig
from brisk.model.llama import LlamaForCausalLM


def make_tiny_llama(tied: bool = False, layers: int = 2, hidden: int = 64) -> LlamaForCausalLM:
    """A random Llama small enough for exact checks (vocab 64, 4 heads, 2 KV heads)."""
    cfg = ModelConfig(vocab_size=64, hidden_size=hidden, intermediate_size=hidden * 3 // 2,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


@pytest.fixture
def tiny_llama() -> Callable[..., LlamaForCausalLM]:
    return make_tiny_llama
