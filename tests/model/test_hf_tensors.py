"""`hf_tensors` is `load_weights` backwards: a model's weights under HF checkpoint names (stacked
Linears split, Gemma's norms as w, partial rotary's dims in HF's order, Phi-3's fused tensors kept
whole) load back into the same weights, bit for bit (Gemma's norm weights: where they lie in
[0.5, 2], as trained norms do; elsewhere w - 1 + 1 may round)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from brisk.config import ModelConfig
from brisk.model.registry import build_model
from tests.parallel.conftest import TINY, TINY_GEMMA

PARTIAL = dataclasses.replace(TINY, architecture="llama", attention_bias=False, head_dim=16, rotary_dim=12)
PHI3 = dataclasses.replace(TINY, architecture="phi3", attention_bias=False)


@pytest.mark.parametrize("cfg", [TINY, TINY_GEMMA, PARTIAL, PHI3], ids=["qwen2", "gemma3", "partial-rotary", "phi3"])
def test_hf_tensors_load_back_bit_for_bit(cfg: ModelConfig) -> None:
    torch.manual_seed(0)
    model = build_model(cfg, torch.float32, max_positions=64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # norms as trained ones are, near 1 (Gemma's w + 1 and back is exact in [0.5, 2]: Sterbenz)
            p.uniform_(0.5, 2.0) if "norm" in name else p.normal_()
    tensors = model.hf_tensors()
    fused = cfg.architecture == "phi3"
    assert ("model.layers.0.self_attn.qkv_proj.weight" in tensors) == fused
    assert ("model.layers.0.mlp.gate_proj.weight" in tensors) != fused
    assert ("lm_head.weight" in tensors) != cfg.tie_word_embeddings
    if cfg.architecture == "gemma3":  # HF stores w where brisk keeps 1 + w
        assert torch.equal(tensors["model.norm.weight"] + 1.0, model.norm.weight)
    again = build_model(cfg, torch.float32, max_positions=64)
    with torch.no_grad():
        again.load_weights(tensors.items())
    ours, theirs = model.state_dict(), again.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_quantized_weights_are_not_written_as_a_checkpoint() -> None:
    model = build_model(TINY, torch.float32, max_positions=64)
    model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(torch.zeros(32, 48, dtype=torch.int8),
                                                              requires_grad=False)
    with pytest.raises(ValueError, match="only a float model"):
        model.hf_tensors()
