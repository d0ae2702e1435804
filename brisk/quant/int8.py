"""int8 weight-only quantization: symmetric, one float32 scale per output channel.

    q[o, i] = round(W[o, i] / s[o]),  s[o] = max_i |W[o, i]| / 127,  q in [-127, 127]
    y = (x @ q^T) * s (+ b)

Decode reads a quarter of float32's bytes; the C++ kernel widens int8 to float32 in registers
and accumulates in float32 (`kernels.int8_gemm`), so the only error is the rounding of W. Up to
128 rows it beats dequantize + float GEMM by 1.1-1.8x (8x on the 49,152-row LM head, where
dequantizing writes 113 MB per call). At 256-512 rows the two are even in isolation and one
in-model run with the kernel at every size was slower (161 vs 178-195 tokens/s batched), so
prefill chunks dequantize per call. Without the kernel (extension not built, not CPU) the weight is
always dequantized.

On the CPU the weight is held in 4-row x 64-column tiles (quant/base.TiledLinear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from brisk.kernels import (
    int8_gemm,
    int8_gemm_supported,
    int8_gemm_tiled,
    int8_kernel_tiles,
)
from brisk.kernels.plan_ops import KIND_INT8, KIND_INT8_TILED, LinearOp
from brisk.model.layers import Linear
from brisk.quant.base import TiledLinear

KERNEL_MAX_ROWS = 128  # up to this many rows the int8 kernel beats dequantize + GEMM (measured)
TILE_COLS = 64  # the tiled kernel's tile: one 64-byte cache line per row


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (int8 [out, in], float32 scale [out])."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(TiledLinear):
    tile_width = TILE_COLS

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 output_sizes: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = qweight.shape[1]
        self.out_features = qweight.shape[0]
        self.output_sizes = output_sizes
        self.dtype = dtype  # what activations and outputs are
        self.register_buffer("qweight", qweight)  # [out, in] int8, row-major or tiled (TiledLinear)
        self.register_buffer("scale", scale)  # [out] float32
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: Linear) -> Int8Linear:
        return cls.from_weight(linear.weight, linear.bias, linear.output_sizes)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None,
                    output_sizes: tuple[int, ...] | None = None) -> Int8Linear:
        q, scale = quantize_per_channel(weight)
        b = None if bias is None else bias.detach().float()
        return cls(q, scale, b, output_sizes or (weight.shape[0],), weight.dtype)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight this module computes with: q * s."""
        return self.qweight_rows().float() * self.scale[:, None]

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), in]: rows of the weight (embedding lookups of a tied head)."""
        return self.qweight_rows(ids).float() * self.scale[ids, None]

    plan_rows = KERNEL_MAX_ROWS  # forward calls plan_op's kernel up to this many rows (runtime/decode_plan.py)

    def plan_op(self) -> LinearOp | None:
        """int8_gemm on the row-major or tiled weight (tiled as the first kernel call would)."""
        b = self._buffers
        if self.dtype != torch.float32 or not int8_gemm_supported(b["qweight"]):
            return None
        tiled = self._tile(int8_kernel_tiles())
        return (KIND_INT8_TILED if tiled else KIND_INT8, b["qweight"], b["scale"], None, b["bias"], 0, 0, tiled)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        b = self._buffers  # plain dict reads, see GroupLinear.forward
        if flat.shape[0] <= KERNEL_MAX_ROWS and (flat.is_cpu if self.tiled else int8_gemm_supported(b["qweight"], flat)):
            if self.tiled or self._tile(int8_kernel_tiles()):
                y = int8_gemm_tiled(flat, b["qweight"], b["scale"], b["bias"])
            else:
                y = int8_gemm(flat, b["qweight"], b["scale"], b["bias"])
        else:
            y = F.linear(flat.float(), self.dequantize(), b["bias"])
        return self._shaped(y, x)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.output_sizes}, int8 per-channel"
