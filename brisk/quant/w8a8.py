"""W8A8: integer matmuls end to end in the linear layers (SmoothQuant, Xiao et al. 2023).

    weights:      q_w[n, k] = round(W[n, k] / s_w[n]),  s_w[n] = max_k |W[n, k]| / 127  (per channel)
    activations:  q_x[m, k] = round(x[m, k] / a[m]),    a[m] = max_k |x[m, k]| / 127     (per token, at run time)
    y[m, n]     = a[m] * s_w[n] * sum_k q_x[m, k] q_w[n, k]      (int32 accumulation, exact)

A few input channels of an LLM's activations are 10-100x larger than the rest, and per-token
int8 then rounds everything else to a handful of levels. With a calibration text, SmoothQuant
moves that range into the weights: column k of W is multiplied by
t_k = max|x_k|^alpha / max|W_k|^(1 - alpha) (alpha 0.5) and x_k is divided by it at run time
(`input_scale` = 1 / t), so both sides quantize well.

Decode-sized batches go through brisk's kernel (`kernels.int8_dot_u8s8`: AVX512-VNNI, 64 int8
products per instruction, ~150 GMAC/s here; AVX-VNNI or vpmaddubsw on AVX2 CPUs); past them
(KERNEL_MAX_ROWS) a oneDNN int8 matmul on a weight packed once (`pack()`, 218-320 GMAC/s), or
torch._int_mm where nothing is packed (it re-lays the weight out on every call).
On CUDA torch._int_mm (cuBLASLt) serves every batch (padded past 16 rows); elsewhere the same
integers are summed in float64 (exact, slow). Results never change with the path: integer sums
have no rounding order, and every path quantizes x to the same integers.
"""

from __future__ import annotations

import torch
from torch import nn

from brisk.kernels import (
    CAPS,
    HAVE_ONEDNN_QLINEAR,
    have_int8_dot,
    int8_dot_u8s8,
    int8_epilogue,
    int8_packed_linear,
    pack_int8_weight,
    quantize_rows,
)
from brisk.kernels.plan_ops import LinearOp
from brisk.model.layers import Linear
from brisk.quant.int8 import Int8Linear

# brisk's kernel up to this many rows, then oneDNN (packed weight or torch._int_mm): with vpdpbusd it led
# to 16 rows (268-371 vs ~160 GMAC/s at 32-128 rows); plain AVX2's vpmaddubsw form (five instructions
# per 32 products) led _int_mm at 1-4 rows (1.4-2.6x) and trailed from 6 (BENCHMARKS.md, issue 25).
KERNEL_MAX_ROWS = 16 if (CAPS.vnni or CAPS.avx_vnni) else 4
SMOOTH_ALPHA = 0.5


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: (q int8 [M, K], a float32 [M]) with x ~ q * a."""
    a = (x.abs().amax(dim=1) / 127).float()
    a = torch.where(a > 0, a, torch.ones_like(a))
    return torch.round(x / a[:, None]).clamp_(-127, 127).to(torch.int8), a


class W8A8Linear(Int8Linear):
    """Int8Linear's weights (per-channel int8), with activations quantized too."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 output_sizes: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__(qweight, scale, bias, output_sizes, dtype)
        self.register_buffer("input_scale", None)  # [in] float32 when smoothed
        # 128 * row sums: the VNNI kernel reads x as uint8 (q + 128); this takes the offset back out
        self.register_buffer("offset", 128 * qweight.sum(dim=1, dtype=torch.int32))
        self.packed: torch.Tensor | None = None  # see pack(); not a buffer: never saved
        self._zero_points: torch.Tensor | None = None

    def pack(self) -> int:
        """Keep a oneDNN-packed copy of the int8 weight for batched rows (the model's pack_weights,
        done by the paged runner on CPU); returns its bytes, 0 where it does not apply."""
        if not (HAVE_ONEDNN_QLINEAR and self.qweight.device.type == "cpu"):
            self.packed = None
            return 0
        self.packed = pack_int8_weight(self.qweight)
        self._zero_points = torch.zeros(self.out_features, dtype=torch.long)
        return self.qweight.numel()

    def set_input_scale(self, input_scale: torch.Tensor) -> None:
        self.input_scale = input_scale.float().contiguous()

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        rows = super().dequantize_rows(ids)
        return rows if self.input_scale is None else rows * self.input_scale

    def _int_dot(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum_k q_x q_w as int32 [M, out], a [M])."""
        if x.device.type == "cpu" and have_int8_dot():  # brisk's C++ quantizer (same integers as quantize_tokens)
            if x.shape[0] <= KERNEL_MAX_ROWS and self.in_features % 64 == 0:
                xq, a = quantize_rows(x, True)
                return int8_dot_u8s8(xq, self.qweight) - self.offset, a
            q, a = quantize_rows(x, False)
            return torch._int_mm(q, self.qweight.t()), a
        q, a = quantize_tokens(x)
        if x.device.type == "cpu":
            return torch._int_mm(q, self.qweight.t()), a
        if x.is_cuda and self.in_features % 8 == 0 and self.out_features % 8 == 0:
            rows = q.shape[0]
            if rows <= 16:  # CUDA's int8 matmul wants more than 16 rows: pad with zeros, drop them after
                q = torch.cat([q, q.new_zeros(17 - rows, q.shape[1])])
            return torch._int_mm(q, self.qweight.t())[:rows], a
        return (q.double() @ self.qweight.double().T).to(torch.int32), a  # exact: sums < 2**53

    def _packed_product(self, x: torch.Tensor) -> torch.Tensor:
        """(acc * scale) * a (+ bias) through the packed oneDNN weight (exactly float(acc) * scale)."""
        assert self.packed is not None and self._zero_points is not None
        if have_int8_dot():
            xq, a = quantize_rows(x, True)
        else:
            q, a = quantize_tokens(x)
            xq = (q.to(torch.int16) + 128).to(torch.uint8)
        y = int8_packed_linear(xq, self.packed, self.scale, self._zero_points).mul_(a[:, None])
        return y if self.bias is None else y.add_(self.bias)

    def plan_op(self) -> LinearOp | None:
        return None  # activations quantized per token: no plan kernel (Int8Linear's op is weight-only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        if self.input_scale is not None:
            flat = flat * self.input_scale
        small = flat.shape[0] <= KERNEL_MAX_ROWS and self.in_features % 64 == 0 and have_int8_dot()
        if self.packed is not None and flat.device.type == "cpu" and not small:
            y = self._packed_product(flat)
        else:
            acc, a = self._int_dot(flat)
            if acc.device.type == "cpu" and have_int8_dot():
                y = int8_epilogue(acc, a, self.scale, self.bias)
            else:
                y = acc.float() * self.scale * a[:, None]  # the C++ epilogue's order
                if self.bias is not None:
                    y = y + self.bias
        return y.to(self.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        smooth = ", smoothed" if self.input_scale is not None else ""
        return f"in={self.in_features}, out={self.output_sizes}, w8a8{smooth}"


def smoothquant_calibrate(model: nn.Module, ids: list[int]) -> dict[Linear, tuple[torch.Tensor | None, None]]:
    """Per decoder Linear, SmoothQuant's column factors from one forward over `ids` (no inputs kept)."""
    from brisk.quant.calibrate import collect_stats

    return {linear: (smooth_scales(linear.weight, stats.abs_max), None)  # type: ignore[arg-type]
            for linear, stats in collect_stats(model, ids).items()}


def smooth_scales(weight: torch.Tensor, x_absmax: torch.Tensor, alpha: float = SMOOTH_ALPHA) -> torch.Tensor:
    """SmoothQuant's per-column factor t (multiply W's columns, divide x's channels)."""
    w_absmax = weight.float().abs().amax(dim=0).clamp(min=1e-5)
    t = x_absmax.clamp(min=1e-5).pow(alpha) / w_absmax.pow(1 - alpha)
    return t.clamp(min=1e-2, max=1e2)
