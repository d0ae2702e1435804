"""Gemma 3 (text): Llama's attention and gated MLP, arranged differently.

- norms before *and after* attention and MLP (four per layer), Gemma's `(1 + w)` RMSNorm: brisk
  stores `1 + w` in the norm weight (`load_tensor`), so the same RMSNorm kernel serves;
- RMSNorm over each query and key head (qk_norm), GELU-tanh gated MLP;
- sliding-window ("local") layers and global layers in the config's pattern, each with its own
  rotary base (local `rope_local_theta`, global `rope_theta` with its scaling);
- embeddings scaled by sqrt(hidden), attention scaled by `query_pre_attn_scalar ** -0.5`,
  head_dim independent of hidden / heads, tied head.
"""

from __future__ import annotations

import torch
from torch import nn

from brisk.config import ModelConfig, RopeScaling
from brisk.model.attention import AttentionMetadata
from brisk.model.base import DecoderLM, Rope, embed_scale
from brisk.model.layers import RMSNorm
from brisk.model.llama import LlamaAttention, LlamaMLP

# The norms whose HF weight w means a scale of (1 + w).
_NORM_SUFFIXES = ("norm.weight", "layernorm.weight")


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.rope_index = 1 if cfg.layer_type(layer_idx) == "sliding" else 0
        eps, hidden = cfg.rms_norm_eps, cfg.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.self_attn = LlamaAttention(cfg, layer_idx, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, dtype)
        self.mlp = LlamaMLP(cfg, dtype, layer_idx)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, dtype)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, ropes: list[Rope],
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # (h, residual) as in Llama: the stream is h + residual, added once right before a norm.
        residual = h if residual is None else h + residual
        cos, sin = ropes[self.rope_index]
        a = self.self_attn(self.input_layernorm(residual), cos, sin, attn_metadata)
        residual = self.post_attention_layernorm(a) + residual
        m = self.mlp(self.pre_feedforward_layernorm(residual))
        return self.post_feedforward_layernorm(m), residual


class Gemma3ForCausalLM(DecoderLM):
    def make_layer(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        return Gemma3DecoderLayer(cfg, layer_idx, dtype)

    def rope_bases(self) -> list[tuple[float, object]]:
        """Global layers: rope_theta with the config's scaling; sliding layers: the local base, unscaled."""
        cfg = self.config
        return [(cfg.rope_theta, cfg.rope_scaling), (cfg.rope_local_theta or cfg.rope_theta, RopeScaling())]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [n, hidden]
        return h * embed_scale(self.config.hidden_size, h.dtype)

    def load_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor + 1.0 if name.endswith(_NORM_SUFFIXES) else tensor

    def save_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor - 1.0 if name.endswith(_NORM_SUFFIXES) else tensor
