"""Optional compiled CPU kernels (brisk._C), with torch fallbacks.

`gemv` is the single-row linear used by decode. When the extension was not built (no compiler at
install time, a non-x86 CPU without a build), `HAVE_CPU_GEMV` is False and callers use F.linear:
the same results, slower decode. Which path runs is decided once, here, at import: `CAPS`
(capability.py) says which instruction set the kernels use (BRISK_CPU_ISA may lower it) and which
kernels exist, and every `*_supported` below asks it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from brisk.errors import UserError
from brisk.kernels.capability import KernelCaps, detect, warn_missing

try:
    from brisk import _C  # type: ignore[attr-defined]

    _LOAD_ERROR = None
except ImportError as e:
    _C = None
    _LOAD_ERROR = f"brisk._C did not import: {e}"

CAPS: KernelCaps = detect(_C, _LOAD_ERROR)
warn_missing(CAPS)
HAVE_CPU_GEMV = CAPS.built
ISA = CAPS.isa if CAPS.built else "none"

GEMV_DTYPES = (torch.float32, torch.bfloat16)
# Where no packed weight exists (pack_weights=False, torch without oneDNN), up to this many rows
# decode batches use `small_gemm` (every ISA: AVX-512, AVX2, portable): it streams the weights once
# and gives each row exactly the result `gemv` gives it alone (batch-invariant decoding). float32
# keeps that up to 32 rows at BLAS speed or better; bfloat16 BLAS (oneDNN, AVX512-BF16) computes
# twice as fast past ~8 rows, and bfloat16 is not the exactness reference, so it stops at 8.
SMALL_GEMM_MAX_ROWS = 32 if CAPS.built else 1
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


def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs a weight of this dtype on this CPU. bfloat16 packing needs AVX512-BW/VL/DQ
    or AVX-NE-CONVERT: on an AVX2-only CPU the reorder raises, so such weights stay plain and run
    through `small_gemm` / F.linear. Asked once with a tiny weight rather than by reading CPU flags,
    so that whatever oneDNN decides is what brisk follows."""
    if not HAVE_ONEDNN_PACKING:
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), PACK_BATCH_HINT)
    except RuntimeError:
        return False
    return True


PACK_DTYPES: frozenset[torch.dtype] = frozenset(d for d in GEMV_DTYPES if _onednn_packs(d))


def pack_supported(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in PACK_DTYPES and weight.dim() == 2


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight reordered once into oneDNN's blocked layout (an opaque mkldnn tensor).

    torch's F.linear hands MKL/oneDNN the plain [out, in] matrix and pays for re-blocking it on
    every call; a pre-packed weight runs batched matmuls ~1.3x (prefill) to 2x (16-64 rows)
    faster on this CPU, which is what vLLM-CPU does too. Costs a second copy of the weight.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)


# Where AMX-BF16 is usable oneDNN's bf16 GEMM picks its kernel by M (rows 24-32 of a 960 x 576
# weight, 12-31 and more of 576 x 1536, 1-20 of a 49152-row head came out otherwise than in a batch
# of 70): bf16 rows then go through in chunks of this many, the last padded with zeros, so a row's
# numbers stay the same in any batch (costs ~1.5x on a 64-row head, ~0.05 ms on small layers).
PACKED_BF16_ROW_CHUNK = 64


def pad_rows(x: torch.Tensor, multiple: int, dtype: torch.dtype) -> torch.Tensor:
    """x [M, in] as `dtype`, zero rows appended up to a multiple of `multiple`: oneDNN's bf16 GEMMs
    on AMX called in fixed row chunks (a row's numbers then do not depend on the batch)."""
    padded = torch.zeros(-(-x.shape[0] // multiple) * multiple, x.shape[1], dtype=dtype)
    padded[:x.shape[0]] = x
    return padded


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] @ W^T (+ bias) with W from `pack_weight`. Each row's result does not depend on M
    for M >= 2 (oneDNN's reduction order is fixed by the packed layout; bf16 on AMX in fixed row
    chunks): checked in the tests."""
    if x.dtype != torch.bfloat16 or not CAPS.cpu_amx:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    m, chunk = x.shape[0], PACKED_BF16_ROW_CHUNK
    padded = pad_rows(x, chunk, x.dtype)
    parts = [torch.ops.mkldnn._linear_pointwise(padded[c:c + chunk], packed, bias, "none", [], "")
             for c in range(0, padded.shape[0], chunk)]
    return (parts[0] if len(parts) == 1 else torch.cat(parts))[:m]


def _have_onednn_qlinear() -> bool:
    try:
        torch.ops.onednn.qlinear_prepack  # noqa: B018 - raises when this torch lacks the op
        torch.ops.onednn.qlinear_pointwise  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return torch.backends.mkldnn.is_available() and _onednn_qlinear_is_exact()


def _onednn_qlinear_is_exact() -> bool:
    """Whether oneDNN's u8 x s8 matmul gives the exact integer sums on this CPU. Without VNNI (an
    AVX2-only CPU) it multiplies with vpmaddubsw, whose pairwise int16 sums saturate: 255 * 127 * 2
    does not fit, and rows came out wrong by up to 1.6 (in a W8A8 layer's float units) on such a
    machine. Checked once on the worst case: every activation 255, every weight 127 or -128."""
    k = 64
    xq = torch.full((2, k), 255, dtype=torch.uint8)
    w = torch.full((16, k), 127, dtype=torch.int8)
    w[1::2] = -128
    try:
        got = int8_packed_linear(xq, pack_int8_weight(w), torch.ones(16), torch.zeros(16, dtype=torch.long))
    except RuntimeError:
        return False
    want = ((xq.long() - 128) @ w.long().T).float()
    return torch.equal(got, want)


def pack_int8_weight(qweight: torch.Tensor) -> torch.Tensor:
    """An int8 [out, in] weight reordered once into oneDNN's layout for `int8_packed_linear`.
    torch._int_mm re-lays the weight out on every call (as F.linear does for float32): at 32 rows
    the packed matmul ran 218 GMAC/s against _int_mm's 85 in one measurement here."""
    return torch.ops.onednn.qlinear_prepack(qweight, [PACK_BATCH_HINT, qweight.shape[1]])


def int8_packed_linear(xq_u8: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                       zero_points: torch.Tensor) -> torch.Tensor:
    """float32 [M, out] = (sum_k (xq_u8 - 128) q_w) * scale[out], exactly float(acc) * scale: the
    activation scale is 1 and its zero point 128 (xq_u8 from `quantize_rows(x, True)`)."""
    return torch.ops.onednn.qlinear_pointwise.tensor(
        xq_u8, _ONE, _OFFSET, packed, scale, zero_points, None, 1.0, 0, torch.float32, "none", [], "")


_ONE = torch.tensor(1.0)
_OFFSET = torch.tensor(128)
HAVE_ONEDNN_QLINEAR = _have_onednn_qlinear()  # here, not beside its function: the probe runs int8_packed_linear


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
        raise UserError(f"gemv: x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} {weight.dtype}")
    return _C.gemv(x, weight, bias)


def small_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] @ weight[out, in]^T (+ bias) -> [M, out] for M <= SMALL_GEMM_MAX_ROWS."""
    assert _C is not None
    if x.dim() != 2 or x.shape[1] != weight.shape[1] or x.dtype != weight.dtype:
        raise UserError(f"small_gemm: x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} {weight.dtype}")
    return _C.small_gemm(x, weight, bias)


def int8_gemm_supported(qweight: torch.Tensor, x: torch.Tensor | None = None) -> bool:
    """True when `int8_gemm` can serve this int8 weight and input: CPU, extension built (every ISA)."""
    return (CAPS.has("int8_gemm") and qweight.device.type == "cpu" and qweight.dtype == torch.int8
            and qweight.is_contiguous() and (x is None or x.device.type == "cpu"))


def int8_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(x [M, in] @ qweight[out, in]^T) * scale[out] (+ bias) -> float32 [M, out]."""
    assert _C is not None
    if x.dim() != 2 or x.shape[1] != qweight.shape[1]:
        raise UserError(f"int8_gemm: x {tuple(x.shape)} does not fit weight {tuple(qweight.shape)}")
    return _C.int8_gemm(x, qweight, scale, bias)


def int8_kernel_tiles() -> bool:
    """True when the build has `int8_gemm_tiled` (where `int8_gemm` serves a weight of whole tiles,
    quant/base.TiledLinear, this one can)."""
    return CAPS.has("int8_gemm_tiled")


def sparse24_gemm(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor, scale: torch.Tensor | None,
                  bias: torch.Tensor | None, in_features: int) -> torch.Tensor:
    """x [M, in] @ W^T (* scale) (+ bias) -> float32 [M, out], W 2:4 sparse (quant/sparse24.py's layout)."""
    assert _C is not None
    if x.dim() != 2 or x.shape[1] != in_features:
        raise UserError(f"sparse24_gemm: x {tuple(x.shape)} does not fit {in_features} input columns")
    return _C.sparse24_gemm(x, values, meta, scale, bias, in_features)


def sparse24_dense(values: torch.Tensor, meta: torch.Tensor, scale: torch.Tensor | None, in_features: int) -> torch.Tensor:
    """The float32 [out, in] weight a 2:4 sparse one stands for."""
    assert _C is not None
    return _C.sparse24_dense(values, meta, scale, in_features)


def int8_gemm_tiled(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """`int8_gemm` on a weight in quant/int8.py's tiled layout; the same numbers, bit for bit."""
    assert _C is not None
    if x.dim() != 2 or x.shape[1] != qweight.shape[1]:
        raise UserError(f"int8_gemm_tiled: x {tuple(x.shape)} does not fit weight {tuple(qweight.shape)}")
    return _C.int8_gemm_tiled(x, qweight, scale, bias)


def group_kernel_supported(qweight: torch.Tensor, x: torch.Tensor | None = None) -> bool:
    """True when `group_gemm` / `group_dequantize` can serve this weight and input: CPU, extension
    built (AVX-512, AVX2 and portable kernels)."""
    return (CAPS.has("group_gemm") and qweight.device.type == "cpu"
            and qweight.is_contiguous() and (x is None or x.device.type == "cpu"))


def ternary_supported(plus: torch.Tensor, x: torch.Tensor | None = None) -> bool:
    """True when `ternary_gemm` can serve these bit planes: on the CPU, at every level (AVX-512, AVX2
    and the portable loop give the same floats)."""
    return CAPS.has("ternary_gemm") and plus.device.type == "cpu" and (x is None or x.device.type == "cpu")


def block_types() -> frozenset[int]:
    """GGML type ids the GGUF block kernels run (cpu_blocks.cpp); empty without the extension."""
    return _BLOCK_TYPES


_BLOCK_TYPES: frozenset[int] = frozenset(_C.block_types()) if CAPS.has("block_types") else frozenset()


def block_kernel_supported(types: list[int], x: torch.Tensor | None = None) -> bool:
    """The block kernels serve weights of these GGML types (on the CPU, every ISA)."""
    return all(t in _BLOCK_TYPES for t in types) and (x is None or x.device.type == "cpu")


# brisk's tiled block layouts (blocks.h kTiled): a type id TILED | GGML type holds that type's blocks
# four weight rows at a time, the same bytes in the same [out, row bytes] tensor.
TILED = 1024
Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 20, 23, 10, 11, 12, 13, 14
Q4_0X4, Q4_1X4, Q5_0X4, Q5_1X4, IQ4_NLX4, IQ4_XSX4, Q2_KX4, Q3_KX4, Q4_KX4, Q5_KX4, Q6_KX4 = (
    TILED | t for t in (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K))


def block_tile_supported(ggml_type: int, rows: torch.Tensor) -> bool:
    """`block_tile` can repack these blocks: a type with a tiled kernel (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS,
    Q2_K to Q6_K) on the CPU, a multiple of 4 rows."""
    return (TILED | ggml_type in _BLOCK_TYPES and rows.device.type == "cpu" and rows.dim() == 2
            and rows.shape[0] % 4 == 0 and CAPS.has("block_tile"))


def block_tile(rows: torch.Tensor, ggml_type: int, out: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
    """(TILED | type, a copy of `rows` repacked four rows at a time for the tile kernel: ~1.7x a Q5_0
    row's speed, cpu_blocks_simd.inc tile_x4), written into `out` when given (rows of a larger tiled
    weight, the right width: a first call without it tells)."""
    assert _C is not None
    return TILED | ggml_type, _C.block_tile(rows, ggml_type, out)


def block_untile(tiles: torch.Tensor, tiled_type: int) -> tuple[int, torch.Tensor]:
    """(the GGML type, the rows in the file's layout) of a tiled weight; any device."""
    assert _C is not None
    return tiled_type & ~TILED, _C.block_untile(tiles.cpu(), tiled_type).to(tiles.device)


def block_dequantize_supported() -> bool:
    """The tiled float path of batched block work (AVX2 or AVX-512)."""
    return CAPS.has("block_dequantize") and CAPS.isa in ("avx2", "avx512")


def block_dequantize(blocks: torch.Tensor, ggml_type: int, in_features: int, r0: int, r1: int) -> torch.Tensor:
    """float32 [r1 - r0, in]: rows of GGUF blocks as the values d q - m the block kernels multiply."""
    assert _C is not None
    return _C.block_dequantize(blocks, ggml_type, in_features, r0, r1)


def bf16_tiles_supported() -> bool:
    """Batched block work runs as bfloat16 tiles of the weight in torch's GEMM: the CPU's AMX-BF16
    tiles are usable (KernelCaps.amx; `BRISK_AMX=0` or `BRISK_CPU_ISA` below avx512 turn it off)."""
    return CAPS.amx and CAPS.has("block_dequantize_bf16")


def block_dequantize_bf16(blocks: torch.Tensor, ggml_type: int, in_features: int, r0: int, r1: int,
                          out: torch.Tensor) -> torch.Tensor:
    """Rows [r0, r1) of GGUF blocks into `out` (bfloat16 [r1 - r0, in], contiguous): the values of
    `block_dequantize` rounded as `.bfloat16()` rounds them, without the float32 matrix."""
    assert _C is not None
    _C.block_dequantize_bf16(blocks, ggml_type, in_features, r0, r1, out)
    return out


KGEMM_TYPES = frozenset((Q2_KX4, Q3_KX4, Q4_KX4, Q5_KX4, Q6_KX4))


def float_prompt_tiles() -> bool:
    """Batched K-quant work without AMX runs float32 GEMMs on tiles of the weight made float (exact
    but for the sums' order) rather than block_kgemm's integer products on x rounded to int8 (+0.2-0.4%
    perplexity at window 512): on Intel CPUs, where torch's float GEMM is at least as fast (a Xeon:
    1.5x block_kgemm at AVX-512, 1.0-1.05x with MKL and oneDNN held to AVX2), not on AMD ones (an
    AVX2 EPYC: 0.82x), or as BRISK_FLOAT_PROMPT_TILES says (KernelCaps.float_tiles). Needs
    block_dequantize (AVX2)."""
    return CAPS.float_tiles and block_dequantize_supported()


def block_kgemm_supported(tiled_type: int) -> bool:
    """`block_kgemm` multiplies weights of this type: a K-quant (Q2_K ... Q6_K) held in tiles."""
    return tiled_type in KGEMM_TYPES and CAPS.has("block_kgemm")


def block_kgemm(x: torch.Tensor, parts: list[tuple[int, torch.Tensor, int]], y: torch.Tensor) -> None:
    """y[:, first:first + rows] = x @ W^T for each (tiled K-quant type, tiles, first) in `parts`,
    x quantized to int8 per 128 columns (llama.cpp's Q8_K takes 256) and each half block summed as
    integers (cpu_blocks_prompt.inc): batched prompt work. y's other columns are left as they are."""
    assert _C is not None
    _C.block_kgemm(x, [rows for _, rows, _ in parts], [t for t, _, _ in parts], [f for _, _, f in parts], y)


def block_gemm(x: torch.Tensor, blocks: list[torch.Tensor], types: list[int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [M, out] = quantize_act_blocks(x, "int8") @ W^T (+ bias), W the row-stacked `blocks`
    (uint8 [rows, row bytes], each of its GGML type), up to the sums' float order."""
    assert _C is not None
    return _C.block_gemm(x, blocks, types, bias)


def group_kernel_tiles() -> bool:
    """True when the group kernels read the tiled layout (quant/base.TiledLinear) given tiled=True."""
    return CAPS.has("group_tile_rows")


def group_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
               group: int, bits: int, bias: torch.Tensor | None = None, tiled: bool = False) -> torch.Tensor:
    """x [M, in] @ W^T (+ bias) -> float32 [M, out], W group-quantized (quant/grouped.py layout;
    `tiled`: held in 4-row tiles, quant/base.tile_rows)."""
    assert _C is not None
    in_features = qweight.shape[1] * (2 if bits == 4 else 1)
    if x.dim() != 2 or x.shape[1] != in_features:
        raise UserError(f"group_gemm: x {tuple(x.shape)} does not fit a weight of {in_features} input features")
    return _C.group_gemm(x, qweight, scale, zero, group, bits, bias, tiled) if tiled else \
        _C.group_gemm(x, qweight, scale, zero, group, bits, bias)


ACT_KERNELS = {"int8": "group_gemm_q8act", "int16": "group_gemm_q16act"}  # quantized-activation modes


def group_qact_supported(mode: str, bits: int) -> bool:
    """True when `group_gemm_qact` runs here for activations `mode` ("int8", "int16") and weights of
    `bits` (4 or 8): extension built (AVX512-VNNI, AVX2 and portable paths, bit-identical; 8-bit x
    int16 has no 512-bit form, the AVX2 kernel serves that level)."""
    return CAPS.has(ACT_KERNELS[mode]) and bits in (4, 8)


def group_gemm_qact(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                    group: int, bits: int, mode: str, bias: torch.Tensor | None = None,
                    tiled: bool = False) -> torch.Tensor:
    """`group_gemm` of x quantized per row and 32-column block to int8 or int16 (`mode`; quant/grouped.py
    quantize_act_blocks): integer dot products with the weights' nibbles or bytes (VNNI)."""
    assert _C is not None
    in_features = qweight.shape[1] * (2 if bits == 4 else 1)
    if x.dim() != 2 or x.shape[1] != in_features:
        raise UserError(f"group_gemm_qact: x {tuple(x.shape)} does not fit a weight of {in_features} input features")
    return getattr(_C, ACT_KERNELS[mode])(x, qweight, scale, zero, group, bits, bias, tiled)


def group_dequantize(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int,
                     bits: int, tiled: bool = False) -> torch.Tensor:
    """The float32 [out, in] weight `group_gemm` computes with (row-major, also from a tiled q)."""
    assert _C is not None
    return _C.group_dequantize(qweight, scale, zero, group, bits, tiled) if tiled else \
        _C.group_dequantize(qweight, scale, zero, group, bits)


def group_dequantize_rows(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int,
                          bits: int, tiled: bool, ids: torch.Tensor) -> torch.Tensor | None:
    """Rows `ids` of `group_dequantize`'s weight, float32 [len(ids), in]; None where the extension lacks it."""
    if not CAPS.has("group_dequantize_rows"):
        return None
    return _C.group_dequantize_rows(qweight, scale, zero, group, bits, tiled, ids)


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when `rms_norm` can serve these float32 CPU tensors (every ISA: AVX-512, AVX2, portable)."""
    return CAPS.has("rms_norm") and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * weight, one pass per row (x [..., h] float32)."""
    assert _C is not None
    return _C.rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps).view(x.shape)


def silu_mul_supported(gate_up: torch.Tensor) -> bool:
    """True when `silu_mul` can serve this [n, 2 * inter] tensor (float32, CPU; AVX-512, AVX2 or portable)."""
    return (CAPS.has("silu_mul") and gate_up.device.type == "cpu"
            and gate_up.dtype == torch.float32 and gate_up.dim() == 2 and gate_up.is_contiguous())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a stacked [gate | up] float32 projection, one pass per row."""
    assert _C is not None
    return _C.silu_mul(gate_up)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a 2-D float tensor (the first maximum; NaN ranks highest), in one
    C++ pass a row for contiguous float32 CPU rows (torch's reduction reads ~1 GB/s: 0.2 ms of a
    262k-vocabulary decode step)."""
    if not (CAPS.has("argmax_rows") and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and x.is_contiguous() and x.shape[1] > 0):
        return x.argmax(dim=-1)
    out = _C.argmax_rows(x)
    if bool((out < 0).any()):  # a row with a NaN: torch's rule for it
        return x.argmax(dim=-1)
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor | None:
    """A copy of [rows, vocab] float32 CPU logits with -inf wherever the grammar's int32
    [rows, words] bitmask clears the token's bit, in one C++ pass; None when the kernel cannot
    serve these tensors (the caller unpacks with torch)."""
    if not (CAPS.has("apply_token_bitmask_") and logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.dim() == 2 and bitmask.dtype == torch.int32 and bitmask.dim() == 2
            and bitmask.shape[0] == logits.shape[0]):
        return None
    out = logits.contiguous().clone()
    _C.apply_token_bitmask_(out, bitmask.contiguous())
    return out


def gelu_tanh_mul_supported(gate_up: torch.Tensor) -> bool:
    """True when `gelu_tanh_mul` can serve this [n, 2 * inter] tensor (as silu_mul_supported)."""
    return CAPS.has("act_mul") and silu_mul_supported(gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up of a stacked [gate | up] float32 projection, one pass per row (the
    decode plan's floats)."""
    assert _C is not None
    return _C.act_mul(gate_up, 1)


def have_int8_dot() -> bool:
    """True when W8A8 runs brisk's `quantize_rows` and `int8_dot_u8s8` here: the extension is built
    and the level is AVX2 or AVX-512 (AVX512-VNNI, AVX-VNNI or vpmaddubsw: the same integers; the
    portable loop is tested but torch._int_mm is faster where brisk has no vector path)."""
    return _HAVE_INT8_DOT


# decided once: W8A8 asks on every call
_HAVE_INT8_DOT = CAPS.has("quantize_rows") and CAPS.has("int8_dot_u8s8") and CAPS.isa in ("avx2", "avx512")


def quantize_rows(x: torch.Tensor, unsigned_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of x [M, K]: (q [M, K], scales float32 [M]); q as uint8 holding
    q + 128 with `unsigned_offset` (for `int8_dot_u8s8`), else int8 (for torch._int_mm)."""
    assert _C is not None
    return _C.quantize_rows(x, unsigned_offset)


def int8_epilogue(acc: torch.Tensor, a: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 (acc * scale) * a[:, None] (+ bias), one pass (same order as the torch expression)."""
    assert _C is not None
    return _C.int8_epilogue(acc, a, scale, bias)


def int8_dot_u8s8(xq: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """int32 [M, N] = xq (uint8 [M, K]) . qweight (int8 [N, K]), K a multiple of 64, on every level."""
    assert _C is not None
    if xq.dim() != 2 or qweight.dim() != 2 or xq.shape[1] != qweight.shape[1] or qweight.shape[1] % 64:
        raise UserError(f"int8_dot_u8s8: x {tuple(xq.shape)} does not fit weight {tuple(qweight.shape)} "
                         "(K must match and be a multiple of 64)")
    return _C.int8_dot_u8s8(xq, qweight)


def ternary_gemm(x: torch.Tensor, plus: torch.Tensor, minus: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] @ T^T * scale (+ bias) -> float32 [M, out], T in two bit planes (quant/ternary.py)."""
    assert _C is not None
    if x.dim() != 2 or x.shape[1] != plus.shape[1] * 8:
        raise UserError(f"ternary_gemm: x {tuple(x.shape)} does not fit {plus.shape[1] * 8} input features")
    return _C.ternary_gemm(x, plus, minus, scale, bias)


def rotary_supported(qkv: torch.Tensor, cos: torch.Tensor) -> bool:
    """True when `rotary` serves these tensors: float32 on the CPU, extension built."""
    return (CAPS.has("rotary") and qkv.device.type == "cpu" and qkv.dtype == torch.float32
            and cos.dtype == torch.float32 and qkv.dim() == 2 and qkv.stride(1) == 1)


def rotary(qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The first `heads` heads of each fused qkv row [n, width], rotated by cos/sin [n, head_dim]
    -> [n, heads, head_dim]; the same floats as model/rotary.apply_rotary."""
    assert _C is not None
    return _C.rotary(qkv, heads, cos.reshape(qkv.shape[0], -1).contiguous(), sin.reshape(qkv.shape[0], -1).contiguous())


def kv_store_supported(k_cache: torch.Tensor) -> bool:
    """True when `kv_store` can write into this cache: on the CPU, contiguous, extension built."""
    return CAPS.has("kv_store") and k_cache.device.type == "cpu" and k_cache.is_contiguous()


def kv_store(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
    """k_cache[b, :, :, o] = k[t] and v_cache[b, :, o] = v[t] for each token t in slot (b, o)."""
    assert _C is not None
    _C.kv_store(k_cache, v_cache, k, v, slot_blocks, slot_offsets)


def paged_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start: torch.Tensor, kv_lens: torch.Tensor, scale: float,
                    window: int = 0) -> None:
    """Exact causal attention of q over a paged KV cache, written into `out` (model/paged_attention.py
    builds the arguments and checks what it hands over); `window` > 0: each query sees only the
    last `window` positions (a sliding layer)."""
    assert _C is not None
    _C.paged_attention(out, q, k_cache, v_cache, block_tables, query_start, kv_lens, scale, window)


def new_decode_plan(num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, eps: float,
                    act: int = 0, max_rows: int = 8) -> Any:
    """An empty C++ DecodePlan (runtime/decode_plan.py fills it layer by layer); act 0: SwiGLU, 1: GeGLU;
    steps of up to `max_rows` tokens."""
    assert _C is not None
    return _C.DecodePlan(num_heads, num_kv_heads, head_dim, intermediate, eps, act, max_rows)


# ----------------------------------------------------------------------------- virtual memory
# The virtual KV layout's calls (kernels/cpu_vmem.cpp): reserve address space, commit and give back pages.

def vmem_unavailable() -> str | None:
    """Why the virtual-memory calls cannot be used here (None: they can)."""
    if not sys.platform.startswith("linux"):
        return f"this platform ({sys.platform}) lacks the Linux calls it needs (mmap MAP_NORESERVE, madvise)"
    if not CAPS.built:
        return f"brisk's C++ extension is not built ({CAPS.load_error})"
    return None if CAPS.has("vmem_reserve") else "this build of brisk._C predates them (rebuild brisk)"


def vmem_page_size() -> int:
    return int(_C.vmem_page_size())


def vmem_reserve(nbytes: int, huge_pages: bool) -> torch.Tensor:
    """A uint8 tensor over `nbytes` of reserved address space, committed page by page on first write."""
    return _C.vmem_reserve(nbytes, huge_pages)


def vmem_populate(buf: torch.Tensor, offset: int, nbytes: int) -> None:
    _C.vmem_populate(buf, offset, nbytes)


def vmem_release(buf: torch.Tensor, offset: int, nbytes: int) -> None:
    _C.vmem_release(buf, offset, nbytes)


def vmem_resident(buf: torch.Tensor, offset: int, nbytes: int) -> int:
    return int(_C.vmem_resident(buf, offset, nbytes))
