"""Vectorised torch dequantization of GGUF tensor data.

One call turns the bytes of one GGUF tensor (as ``GGUFReader`` hands them out, usually a
read-only memory map) into a float32 torch tensor. Every block of a tensor is decoded at once
with torch bit ops; there are no Python loops over blocks. Block layouts follow ggml
(``ggml-quants.c``) and results are bit-identical to ``gguf.quants.dequantize``: each
formula below keeps ggml's order of float operations so rounding matches.

Block layouts (bytes, in order; ``d``/``dmin`` are fp16)::

    Q8_0    [d | 32 x int8]                                    34 B / 32 values
    Q4_0    [d | 16 B nibbles]                                 18 B / 32 values
    Q4_1    [d | m | 16 B nibbles]                             20 B / 32 values
    Q5_0    [d | 4 B high bits | 16 B nibbles]                 22 B / 32 values
    Q5_1    [d | m | 4 B high bits | 16 B nibbles]             24 B / 32 values
    IQ4_NL  [d | 16 B nibbles indexing a 16-entry int8 table]  18 B / 32 values
    Q2_K    [16 B 4-bit scales+mins | 64 B 2-bit q | d | dmin]                  84 B / 256
    Q3_K    [32 B high bits | 64 B 2-bit q | 12 B 6-bit scales | d]            110 B / 256
    Q4_K    [d | dmin | 12 B 6-bit scales+mins | 128 B nibbles]                144 B / 256
    Q5_K    [d | dmin | 12 B scales+mins | 32 B high bits | 128 B nibbles]     176 B / 256
    Q6_K    [128 B low nibbles | 64 B high 2-bits | 16 x int8 scales | d]      210 B / 256
    IQ4_XS  [d | 2 B high scale bits | 4 B low scale bits | 128 B nibbles]     136 B / 256

The remaining i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) and the ternary
TQ1_0 / TQ2_0 and MXFP4 index lattices (grids of 256-2048 entries); they go through the gguf
package's own numpy `quants.dequantize`, which is correct and slower (those files are rare).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from math import prod

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from brisk.errors import UserError

__all__ = ["SUPPORTED", "dequantize"]

_T = GGMLQuantizationType


# ---------------------------------------------------------------- small bit helpers


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte ``start`` of every block, as float32 ``[n_blocks, 1]``."""
    # .contiguous() on the 2-byte column is cheap and makes the dtype view always legal.
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _unpack(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Split each byte of ``x`` [n, bytes] into 8/bits fields of ``bits`` bits.

    Bytes are taken in runs of ``group``; a run yields all its lowest fields first, then the
    next-higher ones (ggml's order), so the result is ``[n, bytes * 8 // bits]`` uint8.
    """
    n = x.shape[0]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=x.device).view(1, 1, -1, 1)  # [1, 1, k, 1]
    fields = (x.reshape(n, -1, 1, group) >> shifts) & ((1 << bits) - 1)  # [n, G, k, group]
    return fields.reshape(n, -1)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte K-quant field into 8 six-bit scales and 8 six-bit mins (float32)."""
    # bytes 0-3: scale 0-3 (low 6) | bytes 4-7: min 0-3 (low 6) | bytes 8-11: low nibble scale
    # 4-7, high nibble min 4-7; the top 2 bits of bytes 0-7 are the high bits of entries 4-7.
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]  # each [n, 4]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)  # [n, 8]
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)  # [n, 8]
    return sc.float(), mn.float()


# ---------------------------------------------------------------- per-type block decoders
# Each takes uint8 blocks [n_blocks, type_size] and returns float32 [n_blocks, block_size].


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    q = b[:, 2:].contiguous().view(torch.int8).float()  # [n, 32]
    return q.mul_(_f16(b, 0))


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _unpack(b[:, 2:], 4, 16).float().sub_(8)  # [n, 32]
    return q.mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _unpack(b[:, 4:], 4, 16).float()  # [n, 32]
    return q.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1's 4-byte field: bit i (little-endian uint32) is the fifth bit of value i."""
    return _unpack(qh, 1, 1)  # byte i // 8, bit i % 8 -> value i


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = (_unpack(b[:, 6:], 4, 16) | (_q5_high(b[:, 2:6]) << 4)).float().sub_(16)  # [n, 32]
    return q.mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = (_unpack(b[:, 8:], 4, 16) | (_q5_high(b[:, 4:8]) << 4)).float()  # [n, 32]
    return q.mul_(_f16(b, 0)).add_(_f16(b, 2))


# IQ4_NL's and IQ4_XS's non-uniform 4-bit grid (ggml's kvalues_iq4nl).
_IQ4_VALUES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                           dtype=torch.float32)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    q = _IQ4_VALUES.to(b.device)[_unpack(b[:, 2:], 4, 16).long()]  # [n, 32]
    return q.mul_(_f16(b, 0))


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    high = _unpack(b[:, 2:4], 2, 1)  # [n, 8]: bits 2 i, 2 i + 1 of the little-endian uint16
    low = _unpack(b[:, 4:8], 4, 1)  # [n, 8]: byte i // 2, low nibble first
    scales = ((low | (high << 4)).to(torch.int16) - 32).float()  # [n, 8]
    dl = (_f16(b, 0) * scales).unsqueeze(-1)  # [n, 8, 1]
    q = _IQ4_VALUES.to(b.device)[_unpack(b[:, 8:], 4, 16).long()].view(-1, 8, 32)  # [n, 8, 32]
    return q.mul_(dl).view(-1, 256)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    scales = b[:, :16]
    dl = (_f16(b, 80) * (scales & 0x0F).float()).unsqueeze(-1)  # [n, 16, 1]
    ml = (_f16(b, 82) * (scales >> 4).float()).unsqueeze(-1)  # [n, 16, 1]
    q = _unpack(b[:, 16:80], 2, 32).view(-1, 16, 16).float()  # [n, 16, 16]
    return q.mul_(dl).sub_(ml).view(-1, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    s = b[:, 96:108]
    low = _unpack(s[:, :8], 4, 8)  # [n, 16]: the 8 bytes' low nibbles, then their high ones
    high = _unpack(s[:, 8:], 2, 4)  # [n, 16]
    scales = ((low | (high << 4)).to(torch.int16) - 32).float()
    dl = (_f16(b, 108) * scales).unsqueeze(-1)  # [n, 16, 1]
    ql = _unpack(b[:, 32:96], 2, 32).to(torch.int16)  # [n, 256]
    hm = _unpack(b[:, :32], 1, 32).to(torch.int16)  # [n, 256]; a clear bit subtracts 4
    q = (ql - ((hm ^ 1) << 2)).view(-1, 16, 16).float()
    return q.mul_(dl).view(-1, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (_f16(b, 0) * sc).unsqueeze(-1)  # [n, 8, 1]
    ml = (_f16(b, 2) * mn).unsqueeze(-1)  # [n, 8, 1]
    q = _unpack(b[:, 16:], 4, 32).view(-1, 8, 32).float()  # [n, 8, 32]
    return q.mul_(dl).sub_(ml).view(-1, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (_f16(b, 0) * sc).unsqueeze(-1)  # [n, 8, 1]
    ml = (_f16(b, 2) * mn).unsqueeze(-1)  # [n, 8, 1]
    ql = _unpack(b[:, 48:], 4, 32)  # [n, 256]
    qh = _unpack(b[:, 16:48], 1, 32)  # [n, 256]; bit i of byte l -> sub-block i, element l
    q = (ql | (qh << 4)).view(-1, 8, 32).float()  # [n, 8, 32]
    return q.mul_(dl).sub_(ml).view(-1, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = _unpack(b[:, :128], 4, 64)  # [n, 256]
    qh = _unpack(b[:, 128:192], 2, 32)  # [n, 256]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    dl = (_f16(b, 208) * scales).unsqueeze(-1)  # [n, 16, 1]
    q = (ql | (qh << 4)).view(-1, 16, 16).float().sub_(32)  # [n, 16, 16]
    return q.mul_(dl).view(-1, 256)


def _f32(b: torch.Tensor) -> torch.Tensor:
    # Copy: the result must never alias a (read-only) memory map of the file.
    return b.view(torch.float32).clone()


def _f16_values(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float16).float()


def _bf16(b: torch.Tensor) -> torch.Tensor:
    # bf16 -> f32 is exact: the bf16 bits become the top half of the f32 bits.
    return b.view(torch.bfloat16).float()


_DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    _T.F32: _f32,
    _T.F16: _f16_values,
    _T.BF16: _bf16,
    _T.Q8_0: _q8_0,
    _T.Q4_0: _q4_0,
    _T.Q4_1: _q4_1,
    _T.Q5_0: _q5_0,
    _T.Q5_1: _q5_1,
    _T.IQ4_NL: _iq4_nl,
    _T.IQ4_XS: _iq4_xs,
    _T.Q2_K: _q2_k,
    _T.Q3_K: _q3_k,
    _T.Q4_K: _q4_k,
    _T.Q5_K: _q5_k,
    _T.Q6_K: _q6_k,
}

# Lattice-indexed types decoded by the gguf package's numpy code (see the module docstring).
_BY_GGUF = frozenset({_T.IQ1_S, _T.IQ1_M, _T.IQ2_XXS, _T.IQ2_XS, _T.IQ2_S, _T.IQ3_XXS, _T.IQ3_S, _T.TQ1_0,
                      _T.TQ2_0, _T.MXFP4})

SUPPORTED: frozenset[GGMLQuantizationType] = frozenset(_DECODERS) | _BY_GGUF


def _by_gguf(qtype: GGMLQuantizationType) -> Callable[[torch.Tensor], torch.Tensor]:
    def decode(b: torch.Tensor) -> torch.Tensor:
        from gguf import quants

        return torch.from_numpy(np.ascontiguousarray(quants.dequantize(b.numpy(), qtype), dtype=np.float32))

    return decode


# ---------------------------------------------------------------- public entry point


def _as_bytes(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A flat uint8 torch view of ``raw``, without copying when it is already contiguous."""
    if isinstance(raw, torch.Tensor):
        return raw.detach().contiguous().view(-1).view(torch.uint8)
    arr = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        # The reader's memory map is read-only. Sharing it is safe: decoders only read their
        # input and every result is a freshly allocated tensor.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(arr)


def _check_size(qtype: GGMLQuantizationType, shape: tuple[int, ...], got: int) -> int:
    """Validate the byte count for ``shape`` in ``qtype``; returns the number of blocks."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if len(shape) == 0 or shape[-1] % block_size != 0:
        raise UserError(
            f"tensor shape {tuple(shape)} does not fit {qtype.name}: the last dimension "
            f"must be a multiple of the block size {block_size}"
        )
    n_blocks = prod(shape) // block_size
    expected = n_blocks * type_size
    if got != expected:
        raise UserError(
            f"tensor data is truncated or corrupt: expected {expected} bytes for shape "
            f"{tuple(shape)} in {qtype.name}, got {got}"
        )
    return n_blocks


def dequantize(
    raw: np.ndarray | torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    """Decode one GGUF tensor to a new float32 tensor of torch-order ``shape``.

    ``raw`` is the tensor's data as ``gguf.GGUFReader`` gives it (any dtype; only its bytes are
    used), possibly a read-only memory map; it is read, never written or aliased by the result.
    Raises ValueError for an unsupported type or a byte count that does not match ``shape``.
    """
    qtype = GGMLQuantizationType(qtype)
    decoder = _DECODERS.get(qtype) or (_by_gguf(qtype) if qtype in _BY_GGUF else None)
    if decoder is None:
        names = ", ".join(t.name for t in sorted(SUPPORTED))
        raise UserError(
            f"GGUF tensor type {qtype.name} is not supported; supported: {names}; "
            f"re-quantize the model to one of them"
        )
    data = _as_bytes(raw)
    n_blocks = _check_size(qtype, tuple(shape), data.numel())
    blocks = data.view(n_blocks, -1) if n_blocks else data.view(0, GGML_QUANT_SIZES[qtype][1])
    return decoder(blocks).reshape(shape)
