"""Architectures brisk can run, by HF `model_type` and GGUF `general.architecture`: one line each."""

from __future__ import annotations

import torch

from brisk.config import ModelConfig
from brisk.errors import UserError
from brisk.model.base import CausalLM, DecoderLM
from brisk.model.gemma3 import Gemma3ForCausalLM
from brisk.model.llama import LlamaForCausalLM

# Mistral, Qwen2, Qwen3 and Phi-3 are Llama-shaped: QKV bias and QK norm are config flags, not
# classes; Phi-3's fused qkv_proj / gate_up_proj tensors fill brisk's stacked Linears whole.
ARCHITECTURES: dict[str, type[DecoderLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "phi3": LlamaForCausalLM,
}
# HF model_type -> the name above, where they differ
ALIASES = {"gemma3_text": "gemma3"}


def canonical_architecture(name: str) -> str:
    """The registry name of an HF model_type or GGUF architecture; a clear error when unknown."""
    name = ALIASES.get(name, name)
    if name not in ARCHITECTURES:
        raise UserError(
            f"model architecture {name!r} is not supported; brisk runs: {', '.join(sorted(ARCHITECTURES))}"
        )
    return name


def build_model(cfg: ModelConfig, dtype: torch.dtype, max_positions: int | None = None) -> CausalLM:
    cls = ARCHITECTURES[canonical_architecture(cfg.architecture)]
    return cls(cfg, dtype=dtype, max_positions=max_positions)
