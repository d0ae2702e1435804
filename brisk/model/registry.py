"""Architectures brisk can run, by HF `model_type` (and GGUF `general.architecture`)."""

from __future__ import annotations

import torch
from torch import nn

from brisk.config import ModelConfig
from brisk.model.llama import LlamaForCausalLM

# Mistral and Qwen2 are Llama-shaped; Qwen2's QKV bias is a config flag, not a new class.
ARCHITECTURES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
}


def check_architecture(name: str) -> None:
    if name not in ARCHITECTURES:
        raise ValueError(
            f"model architecture {name!r} is not supported; brisk runs: {', '.join(sorted(ARCHITECTURES))}"
        )


def build_model(cfg: ModelConfig, dtype: torch.dtype, max_positions: int | None = None) -> LlamaForCausalLM:
    check_architecture(cfg.architecture)
    cls = ARCHITECTURES[cfg.architecture]
    return cls(cfg, dtype=dtype, max_positions=max_positions)  # type: ignore[call-arg,return-value]
