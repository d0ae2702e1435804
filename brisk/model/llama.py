"""Llama-family decoder: Llama 2/3, SmolLM, Mistral, Qwen2 (QKV bias), Qwen3 (QK norm).

One layer: pre-norm attention and pre-norm gated MLP, each added to the residual stream. The
shared stack (embedding, head, rotary tables, weight loading, decode plan) is model/base.py.
"""

from __future__ import annotations

import torch
from torch import nn

from brisk.config import ModelConfig
from brisk.kernels import rotary, rotary_supported
from brisk.model.attention import AttentionMetadata
from brisk.model.base import DecoderLM, Rope
from brisk.model.layers import Linear, RMSNorm, gelu_tanh_and_mul, silu_and_mul, trains
from brisk.model.rotary import apply_rotary

__all__ = ["LlamaAttention", "LlamaDecoderLayer", "LlamaForCausalLM", "LlamaMLP"]


class LlamaAttention(nn.Module):
    """q|k|v in one Linear, rotary on q and k (after a per-head RMSNorm where the config has
    one), exact attention over the cache (the last `window` positions on a sliding layer)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.heads(layer_idx)  # a pruned model's layers may differ (ModelConfig.layer_heads)
        self.num_kv_heads = cfg.kv_heads(layer_idx)
        self.head_dim = cfg.head_dim
        self.window = cfg.window(layer_idx)
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, (q_size, kv_size, kv_size), cfg.attention_bias, dtype)
        self.o_proj = Linear(q_size, (cfg.hidden_size,), cfg.output_bias, dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        n, hd = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)  # [n, (heads + 2 * kv_heads) * head_dim]
        rotated = self.num_heads + self.num_kv_heads
        qk_in = self._normed_qk(qkv) if hasattr(self, "q_norm") else qkv
        # q and k rotate together: one rotary call for both.
        if rotary_supported(qk_in, cos) and not trains(qk_in):
            qk = rotary(qk_in, rotated, cos, sin)  # one C++ pass, the same floats as apply_rotary
        else:
            qk = apply_rotary(qk_in[:, : rotated * hd].view(n, rotated, hd), cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)  # [n, heads, hd], [n, kv_heads, hd]
        v = qkv[:, rotated * hd:].view(n, self.num_kv_heads, hd)
        out = attn_metadata.attend(self.layer_idx, q, k, v, self.window)  # [n, heads, head_dim]
        return self.o_proj(out.reshape(n, self.num_heads * hd))

    def _normed_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """[n, q | k] with every query and key head RMS-normed over head_dim (Qwen3, Gemma 3)."""
        n, hd = qkv.shape[0], self.head_dim
        q = self.q_norm(qkv[:, : self.num_heads * hd].reshape(-1, hd))  # [n * heads, hd]
        k = self.k_norm(qkv[:, self.num_heads * hd: (self.num_heads + self.num_kv_heads) * hd].reshape(-1, hd))
        return torch.cat((q.view(n, -1), k.view(n, -1)), dim=1)  # [n, (heads + kv_heads) * hd]


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layer_idx: int = 0) -> None:
        super().__init__()
        width = cfg.intermediate(layer_idx)
        self.gate_up_proj = Linear(cfg.hidden_size, (width, width), False, dtype)
        self.down_proj = Linear(width, (cfg.hidden_size,), cfg.output_bias, dtype)
        self.act_and_mul = silu_and_mul if cfg.hidden_act == "silu" else gelu_tanh_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.rope_index = 0
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, layer_idx, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, dtype, layer_idx)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, ropes: list[Rope],
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each add happens once, right before a norm.
        residual = h if residual is None else h + residual
        cos, sin = ropes[self.rope_index]
        h = self.self_attn(self.input_layernorm(residual), cos, sin, attn_metadata)
        residual = h + residual
        return self.mlp(self.post_attention_layernorm(residual)), residual


class LlamaForCausalLM(DecoderLM):
    def make_layer(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        return LlamaDecoderLayer(cfg, layer_idx, dtype)
