"""Ternary weights, BitNet b1.58's absmean recipe (Ma et al., 2024), for decoder Linears:

    gamma[o] = mean_i |W[o, i]|,   T[o, i] = clamp(round(W[o, i] / gamma[o]), -1, 1) in {-1, 0, +1}
    y = (x @ T^T) * gamma

BitNet takes one gamma per tensor; brisk takes one per output row, which can only fit better on a
model trained without ternary in mind. T is stored as two bit planes (`plus`, `minus`: 2 bits
per weight, 1/16 of float32), and the C++ kernel adds the activations under +1 and subtracts
those under -1 with masked vector adds: no multiplication until a row meets its gamma.

A model must be trained for this (BitNet trains with ternary weights from the start). Applied
after training to SmolLM2 it destroys the model; `brisk eval ppl -q ternary` reports by how much.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from brisk.errors import UserError
from brisk.kernels import ternary_gemm, ternary_supported
from brisk.model.layers import Linear
from brisk.quant.base import QuantizedLinear

KERNEL_MAX_ROWS = 128
_BITS = torch.arange(8, dtype=torch.uint8)


def quantize_absmean(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (ternary int8 [out, in], gamma float32 [out])."""
    w = weight.float()
    gamma = w.abs().mean(dim=1).clamp(min=1e-8)
    return torch.round(w / gamma[:, None]).clamp_(-1, 1).to(torch.int8), gamma


def pack_planes(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ternary int8 [out, in] -> (plus, minus) uint8 [out, in / 8], bit b of byte j = column 8 j + b."""
    if t.shape[1] % 16:
        raise UserError(f"ternary weights need input features divisible by 16, got {t.shape[1]}")

    def plane(mask: torch.Tensor) -> torch.Tensor:
        bits = mask.to(torch.uint8).reshape(t.shape[0], -1, 8) << _BITS.to(t.device)
        return bits.sum(dim=-1, dtype=torch.uint8).contiguous()  # distinct bits: the sum is an OR

    return plane(t > 0), plane(t < 0)


def unpack_planes(plus: torch.Tensor, minus: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_planes`: ternary int8 [out, in]."""
    def bits(plane: torch.Tensor) -> torch.Tensor:
        return ((plane[..., None] >> _BITS.to(plane.device)) & 1).reshape(plane.shape[0], -1).to(torch.int8)

    return bits(plus) - bits(minus)


class TernaryLinear(QuantizedLinear):
    def __init__(self, plus: torch.Tensor, minus: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 output_sizes: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = plus.shape[1] * 8
        self.out_features = plus.shape[0]
        self.output_sizes = output_sizes
        self.dtype = dtype
        self.register_buffer("plus", plus)
        self.register_buffer("minus", minus)
        self.register_buffer("scale", scale)  # gamma [out] float32
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: Linear) -> TernaryLinear:
        t, gamma = quantize_absmean(linear.weight)
        plus, minus = pack_planes(t)
        bias = None if linear.bias is None else linear.bias.detach().float()
        return cls(plus, minus, gamma, bias, linear.output_sizes, linear.weight.dtype)

    def dequantize(self) -> torch.Tensor:
        return unpack_planes(self.plus, self.minus).float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] <= KERNEL_MAX_ROWS and ternary_supported(self.plus, flat):
            y = ternary_gemm(flat, self.plus, self.minus, self.scale, self.bias)
        else:
            y = F.linear(flat.float(), self.dequantize(), self.bias)
        return y.to(self.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.output_sizes}, ternary (2-bit planes)"
