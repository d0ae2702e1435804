"""Building blocks shared by architectures.

`Linear` is the seam (habit 4): quantization, tensor parallelism and pruning replace or reshape
these modules; architecture files never branch on them. A Linear may stack several logical
projections along its output rows (`output_sizes`, e.g. q|k|v or gate|up) so one matmul serves
them all; loaders fill each part with `load_part`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from brisk.errors import UserError
from brisk.kernels import (
    SMALL_GEMM_ROWS_BY_DTYPE,
    gelu_tanh_mul,
    gelu_tanh_mul_supported,
    gemv,
    gemv_supported,
    pack_supported,
    pack_weight,
    packed_linear,
    rms_norm,
    rms_norm_supported,
    silu_mul,
    silu_mul_supported,
    small_gemm,
)
from brisk.kernels.plan_ops import KIND_FLOAT, LinearOp

# The part of a stacked Linear that a fused checkpoint tensor fills: all of them (Phi-3's qkv_proj).
WHOLE = -1


class Linear(nn.Module):
    """y = x W^T (+ b), with W made of `output_sizes` stacked parts."""

    def __init__(self, in_features: int, output_sizes: tuple[int, ...], bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = output_sizes
        self.out_features = sum(output_sizes)
        # Uninitialised on purpose: every weight comes from a checkpoint.
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(self.out_features, dtype=dtype), requires_grad=False) if bias else None
        )
        self.packed: torch.Tensor | None = None  # see pack(); not a parameter: never saved

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)

    def plan_op(self) -> LinearOp | None:
        """The decode plan's op for this Linear (kernels/plan_ops.py): gemv / small_gemm on float32."""
        w = self.weight
        if w.dtype != torch.float32 or not gemv_supported(w):
            return None
        return (KIND_FLOAT, w, None, None, self.bias, 0, 0, False)

    def pack(self) -> int:
        """Keep a oneDNN-packed copy of the weight for batched rows (kernels.pack_weight); returns
        its bytes, 0 where packing does not apply (not CPU, another dtype, torch without oneDNN)."""
        self.packed = pack_weight(self.weight) if pack_supported(self.weight) else None
        return 0 if self.packed is None else self.weight.numel() * self.weight.element_size()

    def _rows(self, index: int) -> slice:
        start = sum(self.output_sizes[:index])
        return slice(start, start + self.output_sizes[index])

    def load_part(self, index: int, weight: torch.Tensor) -> None:
        """Copy one logical projection's weight into its rows."""
        rows = self._rows(index)
        if tuple(weight.shape) != (rows.stop - rows.start, self.in_features):
            raise UserError(
                f"weight shape {tuple(weight.shape)} does not fit part {index} of a linear layer "
                f"expecting {(rows.stop - rows.start, self.in_features)}; the checkpoint does not match its config"
            )
        self.weight[rows].copy_(weight)

    def load_part_bias(self, index: int, bias: torch.Tensor) -> None:
        if self.bias is None:
            raise UserError("checkpoint has a projection bias but the config says attention_bias=false")
        rows = self._rows(index)
        if tuple(bias.shape) != (rows.stop - rows.start,):
            raise UserError(f"bias shape {tuple(bias.shape)} does not fit part {index} of a linear layer")
        self.bias[rows].copy_(bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.output_sizes}, bias={self.bias is not None}"


# Up to this many rows every Linear (the LM head too) goes through brisk's small GEMM: weights
# streamed once, each row summed exactly as the single-row GEMV sums it. A speculative verify step
# of up to 8 tokens, or a decode batch of up to 8 sequences, then gives every token bit for bit the
# logits it gets alone (greedy speculation is exact, not "up to float ties"), and costs little more
# than one token in the layers (oneDNN's packed GEMM is ~2 ms faster on a 5-row LM head; exactness
# wins). Beyond 8 rows the packed GEMM's speed wins.
SMALL_GEMM_FIRST_ROWS = 8


def trains(*tensors: torch.Tensor | None) -> bool:
    """A tensor here needs gradients (distillation, compress/distill.py): brisk's C++ kernels have
    no backward, so the layers take torch's ops. Inference runs with gradients off and never pays
    more than this check."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, but on CPU: one row through brisk's streaming GEMV (decode is bound by how fast
    weights are read; BLAS reads them at about half speed); more rows through the oneDNN-packed
    weight when there is one; otherwise a few rows through brisk's small GEMM, which reads the
    weights once and gives every row the bit-identical result it would get alone."""
    rows = x.shape[0]
    if x.dim() != 2 or trains(x, weight):
        return F.linear(x, weight, bias)
    if rows == 1 and gemv_supported(weight):
        return gemv(x, weight, bias)
    if rows <= SMALL_GEMM_FIRST_ROWS and rows <= SMALL_GEMM_ROWS_BY_DTYPE.get(weight.dtype, 1) \
            and gemv_supported(weight):
        return small_gemm(x, weight, bias)
    if packed is not None:
        return packed_linear(x, packed, bias)
    if rows <= SMALL_GEMM_ROWS_BY_DTYPE.get(weight.dtype, 1) and gemv_supported(weight):
        return small_gemm(x, weight, bias)
    return F.linear(x, weight, bias)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            if rms_norm_supported(x, self.weight) and not trains(x, self.weight):  # one C++ pass instead of six small torch ops
                return rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Lower precision: normalise in float32 like the reference, then scale in the model dtype.
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)
        return normed * self.weight


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a stacked [gate | up] projection (one C++ pass for float32 CPU rows: the decode
    plan calls the same kernel, so both paths give the same floats)."""
    if silu_mul_supported(gate_up) and not trains(gate_up):
        return silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (tanh-approximated GELU, HF's gelu_pytorch_tanh) on a stacked [gate | up] projection;
    one C++ pass for float32 CPU rows, the decode plan's floats (torch's to float rounding)."""
    if gelu_tanh_mul_supported(gate_up) and not trains(gate_up):
        return gelu_tanh_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
