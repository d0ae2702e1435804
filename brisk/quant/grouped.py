"""Group-quantized Linear: 4-bit with a float scale and offset per group of input columns, or 8-bit
with a scale per group. One module serves the int4 method (round-to-nearest or GPTQ-rounded) and the
GGUF blocks Q4_0, Q4_1 and Q8_0 kept quantized at run time (quant/gguf.py).

Layout (also the C++ kernels', brisk/kernels/cpu_quant.cpp)::

    4-bit  qweight uint8 [out, in/2]: each run of 32 columns takes 16 bytes, GGUF's order:
           byte j = column j (low nibble) | column j+16 (high nibble)
           w[o, i] = fma(q, scale[o, g], zero[o, g]),  g = i // group
    8-bit  qweight int8 [out, in]:  w[o, i] = q * scale[o, g]
    scale, zero: float16 [out, in/group] (GGUF's d and m are float16 too)

So a GGUF Q4_1 block (d, m, 16 bytes) is a group of 32 with scale d and zero m as it stands, a
Q4_0 block is zero = -8 d, and Q8_0 is the 8-bit form: no repacking of the nibbles.

An optional `input_scale` [in] multiplies x before the product: the weight was quantized after its
columns were scaled by 1 / input_scale (AWQ-style scaling, which int4 checkpoints written by brisk
before GPTQ went act-order carry; they still load).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from brisk.errors import UserError
from brisk.kernels import (
    group_dequantize,
    group_dequantize_rows,
    group_gemm,
    group_gemm_qact,
    group_kernel_supported,
    group_kernel_tiles,
    group_qact_supported,
)
from brisk.kernels.plan_ops import GROUP_KINDS, LinearOp
from brisk.model.layers import Linear, trains
from brisk.quant.base import TiledLinear

KERNEL_MAX_ROWS = 128  # past this, dequantizing once and running a float GEMM is faster (prefill)
CHUNK = 32  # columns per nibble run / GGUF block
SCALE_MIN = 2.0**-24  # the smallest float16 (subnormal): an all-zero group still gets a usable scale


ACT_LEVELS = {"int8": 127, "int16": 32767}  # quantized activation modes: largest |integer|


def quantize_act_blocks(x: torch.Tensor, mode: str = "int8", block: int = CHUNK) -> torch.Tensor:
    """x [M, in] float32 as the int8 / int16 kernels see it (`mode`): per row and block of 32 columns
    (`block`: 128 for the K-quant prompt kernel, kernels.block_kgemm), the integers
    round-half-even(x / a), a = max |x| / L (L = 127 or 32767), times a (brisk/kernels/cpu_quant_vnni.cpp)."""
    levels = ACT_LEVELS[mode]
    blocks = x.float().reshape(x.shape[0], -1, block)
    a = blocks.abs().amax(dim=-1, keepdim=True) / levels
    q = torch.round(blocks / torch.where(a > 0, a, torch.ones_like(a))).clamp_(-levels, levels)
    return (q * a).reshape(x.shape)


def check_group(in_features: int, group: int) -> None:
    if group <= 0 or group % CHUNK or in_features % group:
        raise UserError(f"quantization group size {group} must be a multiple of {CHUNK} that divides the "
                         f"{in_features} input features of every layer; try group_size 32 or 64")


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in] with values 0..15 -> uint8 [out, in/2] in the layout above."""
    out = q.shape[0]
    runs = q.reshape(out, -1, 2, 16)  # [out, in/32, (low, high), 16]
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(out, -1).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_nibbles`."""
    runs = packed.reshape(packed.shape[0], -1, 16)
    return torch.stack([runs & 15, runs >> 4], dim=2).reshape(packed.shape[0], -1)


def dequantize_reference(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int,
                         bits: int) -> torch.Tensor:
    """Torch version of the kernels' dequantization (portable fallback, tests): float32 [out, in].

    4-bit values are one fma, q * scale + zero rounded once, as the kernel's table; float64 holds
    q * scale exactly, so one rounding to float32 reproduces it.
    """
    out = qweight.shape[0]
    q = unpack_nibbles(qweight) if bits == 4 else qweight
    q = q.reshape(out, -1, group)
    if bits == 8:
        return (q.float() * scale.float()[..., None]).reshape(out, -1)  # exact: 8 x 11 bits
    assert zero is not None
    return (q.double() * scale.double()[..., None] + zero.double()[..., None]).float().reshape(out, -1)


# Clipping candidates of the grid search: fractions of a group's range cut from its bottom and top
# (at most 0.4 of it in all, so every candidate keeps a positive span).
CLIPS = (0.0, 0.04, 0.08, 0.12, 0.16, 0.2)
SEARCH_ROWS = 16384  # groups per slice of the search


def group_params(w: torch.Tensor, column_weight: torch.Tensor | None = None, search: bool = True,
                 symmetric: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 (scale, zero) for the groups w [..., group]: the asymmetric grid [lo, hi] / 15 (Q4_1's
    min/max) or, with `search`, the clipped range [lo + a r, hi - b r] (a, b in CLIPS, r = hi - lo) whose
    rounding error, weighted per column by `column_weight` (broadcast to w: the inputs' mean square),
    is least. Clipping gives the bulk of a group finer steps at the cost of its extremes; a = b = 0 is
    a candidate, so a group min/max fits exactly (a Q4_1 block at group 32) stays exact. `symmetric`
    adds Q4_0's grid to the search (`_q4_0_grid`), so a Q4_0 block at group 32 stays exact too."""
    if not search:
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        return ((hi - lo) / 15).clamp(min=SCALE_MIN).half(), lo.half()
    group = w.shape[-1]
    flat = w.reshape(-1, group)
    weights = None if column_weight is None else column_weight.expand_as(w).reshape(-1, group)
    # slices of SEARCH_ROWS groups keep the candidates' temporaries in cache: 3x faster than whole matrices
    parts = [_search(flat[i:i + SEARCH_ROWS], None if weights is None else weights[i:i + SEARCH_ROWS], symmetric)
             for i in range(0, flat.shape[0], SEARCH_ROWS)]
    scale, zero = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return scale.reshape(w.shape[:-1]), zero.reshape(w.shape[:-1])


def _q4_0_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0's grid d (q - 8) for the groups w [n, group], d = -(the value of largest |w|) / 8 (llama.cpp
    puts that value at q = 0), as scale d and zero -8 d: d may be negative, as in a Q4_0 block."""
    peak = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    d = (-peak / 8).half()
    return torch.where(d == 0, torch.full_like(d, SCALE_MIN), d), (-8 * d.float()).half()


Fit = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # per group: weighted squared error, scale, zero


def _clipped(lo: torch.Tensor, span: torch.Tensor, a: float, b: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 (scale, zero) of the range [lo + a span, hi - b span] / 15."""
    return ((span * (1 - a - b)) / 15).clamp(min=SCALE_MIN).half(), (lo + a * span).half()


def _pick(w: torch.Tensor, column_weight: torch.Tensor | None, candidates: list[tuple[torch.Tensor, torch.Tensor]],
          best: Fit) -> Fit:
    """Per group of w [n, group], the candidate (scale, zero) with the least rounding error, `best` the
    one to beat (an earlier candidate wins a tie)."""
    best_err, best_scale, best_zero = best
    for scale, zero in candidates:
        sf, zf = scale.float()[..., None], zero.float()[..., None]
        err = (w - torch.round((w - zf) / sf).clamp_(0, 15) * sf - zf).square_()
        err = (err if column_weight is None else err * column_weight).sum(dim=-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale, best_zero = torch.where(better, scale, best_scale), torch.where(better, zero, best_zero)
    return best_err, best_scale, best_zero


def _search(w: torch.Tensor, column_weight: torch.Tensor | None, symmetric: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """`group_params`' search over groups w [n, group], every (a, b) pair: ~40 ms per million weights
    here (a coordinate search, a then b, took a third of that but left 2-3% more error). The grids
    that fit a stored 4-bit block exactly (min/max; Q4_0's with `symmetric`) go first, and the
    clippings search only the groups those leave an error in (a Q4 file's weights: none)."""
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    span = hi - lo
    zeros = torch.zeros_like(lo, dtype=torch.float16)
    first = [_clipped(lo, span, 0.0, 0.0)] + ([_q4_0_grid(w)] if symmetric else [])
    err, scale, zero = _pick(w, column_weight, first, (torch.full_like(lo, float("inf")), zeros, zeros))
    # "exact": every weight within 2^-20 of the group's largest |w| (float32 rounding of d q + m)
    exact = err <= (w.abs().amax(dim=-1) * 2.0**-20).square() * w.shape[-1] * (
        1.0 if column_weight is None else column_weight.amax(dim=-1))
    left = (~exact).nonzero().squeeze(1)
    if left.numel():
        clips = [_clipped(lo[left], span[left], a, b) for a in CLIPS for b in CLIPS if a or b]
        _, scale[left], zero[left] = _pick(w[left], None if column_weight is None else column_weight[left], clips,
                                           (err[left], scale[left], zero[left]))
    return scale, zero


# False while modules are built only for their shapes (a saved checkpoint fills them next): the
# clipping search was ~4.4 s of a 4.8 s int4 checkpoint load, for values thrown away.
CLIP_SEARCH: contextvars.ContextVar[bool] = contextvars.ContextVar("brisk_clip_search", default=True)


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Within: 4-bit round-to-nearest skips the clipping search (the same shapes, cruder values)."""
    token = CLIP_SEARCH.set(False)
    try:
        yield
    finally:
        CLIP_SEARCH.reset(token)


def quantize_rtn_4bit(weight: torch.Tensor, group: int, search: bool | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest: per group a float16 scale and zero (`group_params`: Q4_1's min/max, or of
    the clippings and Q4_0's symmetric grid the one with the least error; `search` None: CLIP_SEARCH),
    and q chosen against the rounded scale and zero, the grid used."""
    out, in_features = weight.shape
    check_group(in_features, group)
    w = weight.float().reshape(out, -1, group)
    scale, zero = group_params(w, search=CLIP_SEARCH.get() if search is None else search, symmetric=True)
    q = torch.round((w - zero.float()[..., None]) / scale.float()[..., None]).clamp_(0, 15).to(torch.uint8)
    return pack_nibbles(q.reshape(out, in_features)), scale.contiguous(), zero.contiguous()


def quantize_sym_8bit(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 8-bit per group (as Q8_0): scale = max |w| / 127."""
    out, in_features = weight.shape
    check_group(in_features, group)
    w = weight.float().reshape(out, -1, group)
    scale = (w.abs().amax(dim=-1) / 127).clamp(min=SCALE_MIN).half()
    q = torch.round(w / scale.float()[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(out, in_features).contiguous(), scale.contiguous()


class GroupLinear(TiledLinear):
    """On the CPU the kernel holds qweight in tiles of 4 rows x one 32-column run (quant/base.TiledLinear)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int,
                 bits: int, bias: torch.Tensor | None, output_sizes: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__()
        if bits not in (4, 8) or (bits == 4) != (zero is not None):
            raise ValueError("GroupLinear: 4-bit weights need a zero per group, 8-bit ones none")
        self.bits, self.group = bits, group
        self.in_features = qweight.shape[1] * (2 if bits == 4 else 1)
        self.out_features = qweight.shape[0]
        check_group(self.in_features, group)
        self.output_sizes = output_sizes
        self.dtype = dtype  # what activations and outputs are
        self.register_buffer("qweight", qweight)  # row-major or tiled (TiledLinear)
        self.tile_width = self.run_bytes(bits)  # qweight columns of one 32-column run
        self.register_buffer("scale", scale)  # [out, in / group] float16
        self.register_buffer("zero", zero)  # [out, in / group] float16, 4-bit only
        self.register_buffer("bias", bias)
        self.register_buffer("input_scale", None)  # [in] float32 in AWQ-scaled checkpoints
        # "int8": x is quantized to int8 per block of 32 columns and meets the weights in integer
        # dot products (llama.cpp's Q4 x Q8): faster on VNNI CPUs, a measured quality cost.
        # "int16": the same with int16: as fast, a rounding ~1e-5 of each block's largest x (8-bit
        # weights too: on an AVX2 CPU their float kernel read a Q8_0 head at ~18 GB/s, int16 at ~25);
        # a float GEMM (past the kernel's rows) takes x as is.
        self.activations = "float"

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, group: int, bits: int,
                    output_sizes: tuple[int, ...] | None = None, dtype: torch.dtype | None = None,
                    calibration: torch.Tensor | None = None) -> GroupLinear:
        """Round-to-nearest, or GPTQ (4-bit) given this layer's calibration X^T X / n [in, in]."""
        if bits == 4 and calibration is not None:
            from brisk.quant.gptq import gptq_quantize

            q, scale, zero = gptq_quantize(weight, calibration, group)
        elif bits == 4:
            q, scale, zero = quantize_rtn_4bit(weight, group)
        else:
            (q, scale), zero = quantize_sym_8bit(weight, group), None
        b = None if bias is None else bias.detach().float()
        return cls(q, scale, zero, group, bits, b, output_sizes or (weight.shape[0],), dtype or weight.dtype)

    @classmethod
    def from_linear(cls, linear: Linear, group: int, bits: int,
                    calibration: torch.Tensor | None = None) -> GroupLinear:
        return cls.from_weight(linear.weight, linear.bias, group, bits, linear.output_sizes, calibration=calibration)

    def set_input_scale(self, input_scale: torch.Tensor) -> None:
        self.input_scale = input_scale.float().contiguous()

    @staticmethod
    def run_bytes(bits: int) -> int:
        """qweight columns (bytes) of one 32-column run: a tile's width in qweight."""
        return CHUNK * bits // 8

    def tiled_buffers(self) -> dict[str, int]:
        # a group's scales (and zeros) for the 4 rows of a tile: one 8-byte load in the kernels
        return {"qweight": self.tile_width, "scale": 1, "zero": 1}

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: the weight applied to x * input_scale."""
        if group_kernel_supported(self.qweight):
            return group_dequantize(self.qweight, self.scale, self.zero, self.group, self.bits, self.tiled)
        zero = None if self.zero is None else self.rows("zero")
        return dequantize_reference(self.qweight_rows(), self.rows("scale"), zero, self.group, self.bits)

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), in]: rows of the effective weight (embedding lookups of a tied head)."""
        b = self._buffers
        rows = None
        if group_kernel_supported(b["qweight"], ids):  # one C++ call, the same floats (a decode token's lookup)
            rows = group_dequantize_rows(b["qweight"], b["scale"], b["zero"], self.group, self.bits, self.tiled,
                                         ids.reshape(-1).long())
        if rows is None:
            zero = None if self.zero is None else self.rows("zero", ids)
            rows = dequantize_reference(self.qweight_rows(ids), self.rows("scale", ids), zero, self.group, self.bits)
        return rows if self.input_scale is None else rows * self.input_scale

    def select_rows(self, ids: torch.Tensor) -> GroupLinear:
        """A GroupLinear of output rows `ids` in this one's stored format (the same values, a
        fraction of the bytes): a draft's vocabulary subset of a quantized head."""
        ids = ids.cpu().long()
        zero = None if self.zero is None else self.rows("zero", ids).clone()
        bias = None if self.bias is None else self.bias[ids].clone()
        sub = GroupLinear(self.qweight_rows(ids).clone(), self.rows("scale", ids).clone(), zero, self.group, self.bits,
                          bias, (len(ids),), self.dtype)
        if self.input_scale is not None:
            sub.set_input_scale(self.input_scale)
        sub.activations = self.activations
        return sub.to(self.qweight.device)

    plan_rows = KERNEL_MAX_ROWS  # forward calls plan_op's kernel up to this many rows (runtime/decode_plan.py)

    def plan_op(self) -> LinearOp | None:
        """The group kernel (float, int8 or int16 activations), the weight tiled as the first kernel
        call would; None with a SmoothQuant input scale or where the integer kernel does not run."""
        b = self._buffers
        if b["input_scale"] is not None or self.dtype != torch.float32 or not group_kernel_supported(b["qweight"]):
            return None
        tiled = self._tile(group_kernel_tiles())
        mode = self.activations
        if mode != "float" and not group_qact_supported(mode, self.bits):
            return None  # the module's float twin of the integer kernels is a torch expression
        return (GROUP_KINDS[mode], b["qweight"], b["scale"], b["zero"], b["bias"], self.group, self.bits, tiled)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        # Buffers straight from the dict: nn.Module.__getattr__ costs ~0.7 us a buffer, and a decode
        # token calls ~120 of these modules (Python was ~1.5 ms of an ~11 ms int4 step).
        b = self._buffers
        if b["input_scale"] is not None:
            flat = flat.float() * b["input_scale"]
        # tiled: the weight is already on the CPU in the kernel's layout
        mode = self.activations
        if trains(flat):  # the kernels have no backward: torch's ops on the same weights (stream training)
            return self._shaped(F.linear(flat.float(), self.dequantize(), b["bias"]), x)
        if flat.shape[0] <= KERNEL_MAX_ROWS and (flat.is_cpu if self.tiled else group_kernel_supported(b["qweight"], flat)):
            tiled = self.tiled or self._tile(group_kernel_tiles())  # may replace the buffers
            if mode != "float" and group_qact_supported(mode, self.bits):
                y = group_gemm_qact(flat, b["qweight"], b["scale"], b["zero"], self.group, self.bits, mode, b["bias"],
                                    tiled)
            else:  # a build without the integer-activation kernels: the same activations, multiplied in floats
                flat = flat if mode == "float" else quantize_act_blocks(flat, mode)
                y = group_gemm(flat, b["qweight"], b["scale"], b["zero"], self.group, self.bits, b["bias"], tiled)
        else:
            # a float GEMM (prompt chunks, devices without the kernels): int8 activations are the
            # user's measured choice and stay; int16 exists only to feed the integer kernels (its
            # rounding is ~1e-5 of a block's max), so x goes in as is, as BlockLinear's float path
            # does: 3-15% of a 512-row Q8_0 call, the Python rounding's cost
            flat = quantize_act_blocks(flat, mode) if mode == "int8" else flat.float()
            y = F.linear(flat, self.dequantize(), b["bias"])
        return self._shaped(y, x)

    def extra_repr(self) -> str:
        awq = ", awq" if self.input_scale is not None else ""
        return f"in={self.in_features}, out={self.output_sizes}, {self.bits}-bit group {self.group}{awq}"
