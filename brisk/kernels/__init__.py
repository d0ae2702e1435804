"""Optional compiled CPU kernels (brisk._C), with torch fallbacks.

`gemv` is the single-row linear used by decode. When the extension was not built (no compiler at
install time, a non-x86 CPU without a build), `HAVE_CPU_GEMV` is False and callers use F.linear:
the same results, slower decode. Which path runs is decided once, here, at import.
"""

from __future__ import annotations

import torch

try:
    from brisk import _C  # type: ignore[attr-defined]

    HAVE_CPU_GEMV = True
    ISA = str(_C.isa())
except ImportError:
    _C = None
    HAVE_CPU_GEMV = False
    ISA = "none"

GEMV_DTYPES = (torch.float32, torch.bfloat16)
# Where no packed weight exists (pack_weights=False, torch without oneDNN), up to this many rows
# decode batches use `small_gemm` (AVX-512 only): it streams the weights once
# and gives each row exactly the result `gemv` gives it alone (batch-invariant decoding). float32
# keeps that up to 32 rows at BLAS speed or better; bfloat16 BLAS (oneDNN, AVX512-BF16) computes
# twice as fast past ~8 rows, and bfloat16 is not the exactness reference, so it stops at 8.
SMALL_GEMM_MAX_ROWS = 32 if ISA == "avx512" else 1
SMALL_GEMM_ROWS_BY_DTYPE = {torch.float32: SMALL_GEMM_MAX_ROWS, torch.bfloat16: min(8, SMALL_GEMM_MAX_ROWS)}


def _have_onednn_packing() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight  # noqa: B018 - raises when this torch lacks the op
        torch.ops.mkldnn._linear_pointwise  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


HAVE_ONEDNN_PACKING = _have_onednn_packing()
PACK_BATCH_HINT = 32  # the batch oneDNN tunes the packed layout for; any batch size still works


def pack_supported(weight: torch.Tensor) -> bool:
    return HAVE_ONEDNN_PACKING and weight.device.type == "cpu" and weight.dtype in GEMV_DTYPES and weight.dim() == 2


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight reordered once into oneDNN's blocked layout (an opaque mkldnn tensor).

    torch's F.linear hands MKL/oneDNN the plain [out, in] matrix and pays for re-blocking it on
    every call; a pre-packed weight runs batched matmuls ~1.3x (prefill) to 2x (16-64 rows)
    faster on this CPU, which is what vLLM-CPU does too. Costs a second copy of the weight.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] @ W^T (+ bias) with W from `pack_weight`. Each row's result does not depend on M
    for M >= 2 (oneDNN's reduction order is fixed by the packed layout): checked in the tests."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def gemv_supported(weight: torch.Tensor) -> bool:
    """True when `gemv` can serve this weight: CPU, float32/bfloat16, contiguous, extension built."""
    return (HAVE_CPU_GEMV and weight.device.type == "cpu" and weight.dtype in GEMV_DTYPES
            and weight.dim() == 2 and weight.is_contiguous())


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, in] @ weight[out, in]^T (+ bias) -> [1, out], streaming the weight once.

    Arguments are checked here rather than only in C++: an exception thrown across the extension
    boundary can crash a process whose torch was built by another compiler (seen on a CUDA image).
    """
    assert _C is not None
    if x.numel() != weight.shape[1] or x.dtype != weight.dtype:
        raise ValueError(f"gemv: x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} {weight.dtype}")
    return _C.gemv(x, weight, bias)


def small_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] @ weight[out, in]^T (+ bias) -> [M, out] for M <= SMALL_GEMM_MAX_ROWS."""
    assert _C is not None
    if x.dim() != 2 or x.shape[1] != weight.shape[1] or x.dtype != weight.dtype:
        raise ValueError(f"small_gemm: x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} {weight.dtype}")
    return _C.small_gemm(x, weight, bias)


def int8_gemm_supported(qweight: torch.Tensor) -> bool:
    """True when `int8_gemm` can serve this int8 weight: CPU with AVX-512, extension built."""
    return SMALL_GEMM_MAX_ROWS > 1 and qweight.device.type == "cpu" and qweight.dtype == torch.int8 and qweight.is_contiguous()


def int8_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(x [M, in] @ qweight[out, in]^T) * scale[out] (+ bias) -> float32 [M, out]."""
    assert _C is not None
    if x.dim() != 2 or x.shape[1] != qweight.shape[1]:
        raise ValueError(f"int8_gemm: x {tuple(x.shape)} does not fit weight {tuple(qweight.shape)}")
    return _C.int8_gemm(x, qweight, scale, bias)
