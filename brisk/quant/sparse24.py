"""2:4 semi-structured sparse Linears: of every 4 input columns of a weight row, the 2 that matter
most are kept, stored packed (kernels/cpu_sparse24.cpp: the kept values and 2-bit positions) and
the rest are never read.

With calibration text the selection is SparseGPT's (Frantar and Alistarh, 2023): the kept
weights are also updated to absorb what the pruned ones did (on the default model: WikiText-2
perplexity 174.7 with Wanda's |W| x ||x|| selection alone, see BENCHMARKS.md for SparseGPT's);
without it, the largest |W| of each group of 4. Values
are float32 ("sparse24", about 56% of the dense weight's bytes) or int8 with one scale per row
("sparse24_int8": 62.5% of int8's bytes). Decode-sized batches run the sparse kernel; longer
prefill chunks rebuild the dense weight per call and multiply it through oneDNN, as int8 does.

On CUDA, a float16 / bfloat16 model's 2:4 weights become torch's semi-structured sparse tensors
(cuSPARSELt or CUTLASS, sparse tensor cores from compute capability 8.0): the GPU reads the kept
half. A float32 model keeps the dense weight there: the sparse float32 kernels compute in TF32,
which is not the float32 arithmetic the rest of the model does.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from brisk import kernels
from brisk.errors import UserError
from brisk.kernels.plan_ops import KIND_SPARSE24, LinearOp
from brisk.model.layers import Linear
from brisk.quant.base import QuantizedLinear

TILE, KEPT = 32, 16  # input columns per meta word, kept values per tile
# Up to this many rows the sparse kernel; more: the dense weight through oneDNN. With a batch's rows
# sharing each tile's indices, the kernel matched the dense path at ~32-48 rows on this Xeon
# (3072 x 576 and 576 x 1536, float32 and int8; BENCHMARKS.md, Pruning): a decode batch of 32 stays sparse.
KERNEL_MAX_ROWS = 32
# Added to the Hessian's diagonal, as a fraction of its mean (SparseGPT's default is 0.01). On the
# default model, 8,192 calibration tokens, the first 8,192 WikiText-2 test tokens: KL to the dense
# model 1.55 at 0.01, 1.49 at 0.1, 1.70 at 1.0 (GPTQ's damping here, quant/gptq.py).
SPARSEGPT_DAMP = 0.1
SEMI_STRUCTURED_DTYPES = (torch.float16, torch.bfloat16)
log = logging.getLogger(__name__)


def semi_structured(dense: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """torch's 2:4 sparse tensor of `dense` (zeros where pruned) in `dtype` on its GPU, or None (with
    the reason logged once per cause) where the device, dtype or shape cannot have one."""
    if dense.device.type != "cuda" or dtype not in SEMI_STRUCTURED_DTYPES:
        return None
    if torch.cuda.get_device_capability(dense.device) < (8, 0):
        _warn_once(f"{torch.cuda.get_device_name(dense.device)} has no sparse tensor cores (compute capability < 8.0)")
        return None
    try:
        sparse = torch.sparse.to_sparse_semi_structured(dense.to(dtype))
        F.linear(torch.zeros(1, dense.shape[1], dtype=dtype, device=dense.device), sparse)  # the product runs too
        return sparse
    except (RuntimeError, ValueError, NotImplementedError) as e:  # shape constraints, no backend
        _warn_once(f"torch cannot make a {list(dense.shape)} {dtype} semi-structured tensor ({e})")
        return None


@functools.cache
def _warn_once(why: str) -> None:  # once per reason, not once per Linear
    log.warning("2:4 weights run dense on this GPU: %s", why)


def _int32(bits: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit patterns held in int64 -> the same bits as int32."""
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)


def select_24(weight: torch.Tensor, norms: torch.Tensor | None) -> torch.Tensor:
    """bool [out, in]: the 2 columns of every group of 4 with the largest |W| * ||x|| (|W| without norms)."""
    out, n = weight.shape
    if n % 4:
        raise UserError(f"2:4 sparsity needs input widths divisible by 4; this Linear has {n} columns")
    score = weight.detach().float().abs()
    if norms is not None:
        score = score * norms.float()[None, :]
    top = score.view(out, n // 4, 4).topk(2, dim=-1).indices  # [out, groups, 2]
    keep = torch.zeros(out, n // 4, 4, dtype=torch.bool, device=weight.device)
    keep.scatter_(-1, top, True)
    return keep.view(out, n)


def sparsegpt_24(weight: torch.Tensor, xtx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT's 2:4 (Frantar and Alistarh, 2023): columns swept in order as GPTQ sweeps them
    (quant/gptq.py, whose damped inverse Hessian it shares); at each group of 4 the 2 with the
    largest w^2 / [H^-1]_ii^2 are kept, and each pruned weight's error is spread over the columns
    not yet swept. Returns (the updated weight with zeros where pruned, the kept mask)."""
    from brisk.quant.gptq import BLOCK, _inverse_hessian

    out, n = weight.shape
    w = weight.detach().float().cpu().clone()
    hinv, dead = _inverse_hessian(xtx.cpu(), n, SPARSEGPT_DAMP)
    w[:, dead] = 0
    keep = torch.zeros(out, n, dtype=torch.bool)
    for b0 in range(0, n, BLOCK):
        b1 = min(b0 + BLOCK, n)
        wb, hb = w[:, b0:b1], hinv[b0:b1, b0:b1]  # views: updates land in w
        err = torch.zeros(out, b1 - b0)
        for i in range(b1 - b0):
            if i % 4 == 0:
                score = wb[:, i:i + 4].pow(2) / torch.diagonal(hb)[i:i + 4].pow(2)[None, :]
                keep[:, b0 + i:b0 + i + 4].scatter_(1, score.topk(2, dim=1).indices, True)
            col = wb[:, i]
            e = (col - col * keep[:, b0 + i]) / hb[i, i]
            wb[:, i:] -= e[:, None] * hb[i, i:][None, :]
            err[:, i] = e
        w[:, b1:] -= err @ hinv[b0:b1, b1:]
    return (w * keep).to(weight.device), keep.to(weight.device)


def pack_24(weight: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values float32 [out, tiles * 16], meta int32 [out, tiles]) of `weight` where `keep` holds
    exactly 2 of every 4 columns (the layout of kernels/cpu_sparse24.cpp)."""
    out, n = weight.shape
    tiles = -(-n // TILE)
    w = torch.zeros(out, tiles * TILE, dtype=torch.float32, device=weight.device)
    w[:, :n] = weight.detach().float()
    k = torch.zeros(out, tiles * TILE, dtype=torch.bool, device=weight.device)
    k[:, :n] = keep
    k[:, n:].view(out, -1, 4)[..., :2] = True  # padding groups: columns 0 and 1, zero values
    groups = k.view(out, -1, 4)
    if not bool((groups.sum(-1) == 2).all()):
        raise UserError("2:4 packing needs exactly 2 kept columns in every group of 4")
    pos = groups.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :2].sort(dim=-1).values
    values = w.view(out, -1, 4).gather(-1, pos).reshape(out, tiles * KEPT)
    shifts = 2 * torch.arange(KEPT, dtype=torch.int64, device=weight.device)
    meta = (pos.reshape(out, tiles, KEPT).to(torch.int64) << shifts).sum(-1)
    return values.contiguous(), _int32(meta).contiguous()


def dense_24(values: torch.Tensor, meta: torch.Tensor, scale: torch.Tensor | None, in_features: int) -> torch.Tensor:
    """The float32 [out, in] weight packed values stand for (torch ops: any device)."""
    out, tiles = meta.shape
    shifts = 2 * torch.arange(KEPT, dtype=torch.int64, device=meta.device)
    pos = (meta.to(torch.int64)[..., None] >> shifts) & 3  # [out, tiles, 16]
    cols = (torch.arange(tiles, device=meta.device)[:, None] * TILE
            + 4 * (torch.arange(KEPT, device=meta.device) // 2))[None] + pos
    v = values.float() if scale is None else values.float() * scale.float()[:, None]
    w = torch.zeros(out, tiles * TILE, dtype=torch.float32, device=values.device)
    w.scatter_(1, cols.reshape(out, -1), v.reshape(out, -1))
    return w[:, :in_features]


class Sparse24Linear(QuantizedLinear):
    def __init__(self, values: torch.Tensor, meta: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                 in_features: int, output_sizes: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = values.shape[0]
        self.output_sizes = output_sizes
        self.dtype = dtype
        self.register_buffer("values", values)  # [out, tiles * 16] float32, or int8 times scale
        self.register_buffer("meta", meta)  # [out, tiles] int32: 2-bit positions of the kept values
        self.register_buffer("scale", scale)  # [out] float32 for int8 values, else None
        self.register_buffer("bias", bias)
        self._dense: torch.Tensor | None = None  # off the CPU: the dense weight, built on first use

    @classmethod
    def from_linear(cls, linear: Linear, xtx: torch.Tensor | None = None, int8: bool = False) -> Sparse24Linear:
        """With `xtx` (X^T X / n of calibration inputs): SparseGPT's selection and update; without:
        the largest |W| of every group of 4."""
        w = linear.weight.detach().float()
        if xtx is None:
            values, meta = pack_24(w, select_24(w, None))
        else:
            if w.shape[1] % 4:
                select_24(w, None)  # its error for widths 2:4 cannot split
            values, meta = pack_24(*sparsegpt_24(w, xtx))
        scale = None
        if int8:
            scale = (values.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
            values = torch.round(values / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().float()
        return cls(values, meta, scale, bias, linear.in_features, linear.output_sizes, linear.weight.dtype)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self._dense = None  # moved or cast: rebuilt from the packed buffers
        return super()._apply(fn, recurse)

    @property
    def int8(self) -> bool:
        return self._buffers["scale"] is not None

    def dequantize(self) -> torch.Tensor:
        """The float32 [out, in] weight this module computes with (zeros where pruned)."""
        b = self._buffers
        if self.supported(b["values"]):
            return kernels.sparse24_dense(b["values"], b["meta"], b["scale"], self.in_features)
        return dense_24(b["values"], b["meta"], b["scale"], self.in_features)  # type: ignore[arg-type]

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dequantize()[ids]

    @staticmethod
    def supported(values: torch.Tensor | None, x: torch.Tensor | None = None) -> bool:
        return (kernels.CAPS.has("sparse24_gemm") and values is not None and values.device.type == "cpu"
                and (x is None or x.device.type == "cpu"))

    plan_rows = KERNEL_MAX_ROWS  # forward calls plan_op's kernel up to this many rows (runtime/decode_plan.py)

    def plan_op(self) -> LinearOp | None:
        """The sparse kernel on the packed values (float32 or int8 with their row scales)."""
        b = self._buffers
        if self.dtype != torch.float32 or not self.supported(b["values"]):
            return None
        return (KIND_SPARSE24, b["values"], b["scale"], b["meta"], b["bias"], self.in_features, 0, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        b = self._buffers
        if flat.shape[0] <= KERNEL_MAX_ROWS and self.supported(b["values"], flat):
            y = kernels.sparse24_gemm(flat, b["values"], b["meta"], b["scale"], b["bias"], self.in_features)
        elif flat.device.type != "cpu":
            # The weight for this device, made once and kept: torch's semi-structured sparse tensor
            # where the GPU and the model's dtype allow one, else the dense weight (correct, not faster)
            if self._dense is None or self._dense.device != flat.device:
                dense = self.dequantize()
                self._dense = semi_structured(dense, self.dtype)
                if self._dense is None:
                    self._dense = dense
            w, bias = self._dense, b["bias"]
            y = F.linear(flat.to(w.dtype), w, None if bias is None else bias.to(w.dtype))
        else:
            y = F.linear(flat.float(), self.dequantize(), b["bias"])
        if y.dtype != self.dtype:
            y = y.to(self.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.output_sizes}, 2:4 {'int8' if self.int8 else 'float32'}"
