"""brisk.loader.dequant must decode GGUF blocks bit-identically to the gguf package.

Reference: ``gguf.quants.dequantize`` (llama.cpp's own Python port of ggml's dequantizers).
Our torch code keeps ggml's order of float operations, so every comparison is exact.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf import quants as gq

from brisk.loader.dequant import SUPPORTED, dequantize

T = GGMLQuantizationType


def _assert_same(ours: torch.Tensor, ref: np.ndarray, shape: tuple[int, ...]) -> None:
    assert ours.dtype == torch.float32
    assert tuple(ours.shape) == shape
    expected = torch.from_numpy(np.array(ref, dtype=np.float32)).reshape(shape)
    torch.testing.assert_close(ours, expected, atol=0, rtol=0)


# ---------------------------------------------------------------- real tensors from the model


@pytest.fixture(scope="module")
def reader(gguf_path: Path) -> GGUFReader:
    return GGUFReader(str(gguf_path))


@pytest.mark.parametrize(
    ("name", "qtype", "max_rows"),
    [
        ("token_embd.weight", T.Q8_0, 512),  # 49152 rows: a slice keeps the test fast
        ("blk.0.attn_norm.weight", T.F32, None),
        ("output_norm.weight", T.F32, None),
        ("blk.0.ffn_down.weight", T.Q4_1, None),
        ("blk.0.attn_q.weight", T.Q4_1, None),
        ("blk.29.ffn_gate.weight", T.Q4_1, None),
    ],
)
def test_real_tensors_match_gguf(
    reader: GGUFReader, name: str, qtype: GGMLQuantizationType, max_rows: int | None
) -> None:
    tensor = next(t for t in reader.tensors if t.name == name)
    assert tensor.tensor_type == qtype
    data = tensor.data if max_rows is None else tensor.data[:max_rows]
    cols = int(tensor.shape[0])  # GGUF shape is innermost-first
    shape = (cols,) if data.ndim == 1 else (data.shape[0], cols)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the read-only memmap must not trigger a warning
        ours = dequantize(data, qtype, shape)
    _assert_same(ours, gq.dequantize(data, qtype), shape)


def test_result_does_not_alias_readonly_memmap(reader: GGUFReader) -> None:
    tensor = next(t for t in reader.tensors if t.tensor_type == T.F32)
    assert not tensor.data.flags.writeable
    before = np.array(tensor.data)
    out = dequantize(tensor.data, T.F32, tuple(int(x) for x in reversed(tensor.shape)))
    out.add_(1.0)  # would crash or corrupt the file if it shared the memmap
    np.testing.assert_array_equal(np.asarray(tensor.data), before)


# ---------------------------------------------------------------- synthetic blocks


def _values(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 3.0, (rows, 1))).astype(np.float32)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.BF16])
def test_quantized_by_gguf_match(qtype: GGMLQuantizationType) -> None:
    shape = (37, 256)
    raw = gq.quantize(_values(*shape, seed=int(qtype)), qtype)  # uint8 [rows, bytes_per_row]
    _assert_same(dequantize(raw, qtype, shape), gq.dequantize(raw, qtype), shape)


def test_f16_typed_and_byte_views_match() -> None:
    shape = (9, 64)
    raw = gq.quantize(_values(*shape, seed=5), T.F16)  # float16 [rows, cols], as the reader gives
    ref = gq.dequantize(raw, T.F16)
    _assert_same(dequantize(raw, T.F16, shape), ref, shape)
    _assert_same(dequantize(raw.view(np.uint8), T.F16, shape), ref, shape)


# Byte offsets of the fp16 fields (d, dmin) inside one block, for random blocks of every type
# (gguf.quants cannot quantize most of them). Random bytes are valid blocks once these are finite;
# IQ1_M (its d is spread over the scale bytes) and MXFP4 (an e8m0 exponent) may decode to inf/NaN,
# which both sides must then agree on.
_FP16_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.IQ4_NL: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_XS: (0,),
    T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,), T.IQ1_S: (0,),
    T.IQ1_M: (), T.TQ1_0: (52,), T.TQ2_0: (64,), T.MXFP4: (),
}


def _random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random block bytes with valid (finite) fp16 scale fields."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block_size
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for offset in _FP16_FIELDS[qtype]:
        scale = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(rows, cols // block_size * type_size)


@pytest.mark.parametrize("qtype", sorted(_FP16_FIELDS))
def test_random_blocks_match(qtype: GGMLQuantizationType) -> None:
    shape = (24, 512)
    raw = _random_blocks(qtype, *shape, seed=int(qtype))
    ours = dequantize(raw, qtype, shape)
    expected = torch.from_numpy(np.array(gq.dequantize(raw, qtype), dtype=np.float32)).reshape(shape)
    torch.testing.assert_close(ours, expected, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q5_1])
def test_quantized_by_gguf_match_32_blocks(qtype: GGMLQuantizationType) -> None:
    shape = (13, 96)  # rows that are not whole 256-blocks
    raw = gq.quantize(_values(*shape, seed=int(qtype)), qtype)
    _assert_same(dequantize(raw, qtype, shape), gq.dequantize(raw, qtype), shape)


def test_torch_input_and_3d_shape() -> None:
    shape = (2, 3, 64)
    raw = gq.quantize(_values(6, 64, seed=11), T.Q8_0)
    ours = dequantize(torch.from_numpy(raw), T.Q8_0, shape)
    _assert_same(ours, gq.dequantize(raw, T.Q8_0), shape)


def test_every_supported_type_is_covered() -> None:
    tested = {T.F32, T.F16, T.BF16, *_FP16_FIELDS}
    assert SUPPORTED == frozenset(tested)


def test_what_llama_cpp_writes_is_supported() -> None:
    """Every tensor type llama.cpp's quantizer writes in common files loads (issue 18's list)."""
    common = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
              "Q6_K", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"}
    assert {T[name] for name in common} <= SUPPORTED


# ---------------------------------------------------------------- errors


def test_unsupported_type_names_it_and_lists_supported() -> None:
    raw = np.zeros((1, GGML_QUANT_SIZES[T.Q8_1][1]), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"Q8_1 is not supported; supported: .*Q4_1.*Q6_K"):
        dequantize(raw, T.Q8_1, (1, 256))


@pytest.mark.parametrize("qtype", sorted(SUPPORTED))
def test_truncated_data_raises(qtype: GGMLQuantizationType) -> None:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    shape = (4, 256)
    good = 4 * 256 // block_size * type_size
    raw = np.zeros(good - type_size, dtype=np.uint8)
    with pytest.raises(ValueError, match=rf"truncated or corrupt: expected {good} bytes .* got {good - type_size}"):
        dequantize(raw, qtype, shape)


def test_row_not_multiple_of_block_raises() -> None:
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        dequantize(np.zeros(34, dtype=np.uint8), T.Q8_0, (1, 33))


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_torch_decoders_run_on_the_blocks_device(device: str) -> None:
    """Every type decoded by torch ops decodes where its blocks are (a GGUF model's blocks on a GPU
    dequantize there): no constant is left on the CPU (meta tensors catch one, as CUDA would)."""
    from brisk.loader.dequant import _DECODERS

    for qtype in sorted(_DECODERS):
        if qtype not in _FP16_FIELDS:
            continue
        raw = torch.from_numpy(_random_blocks(qtype, 8, 256, seed=int(qtype)))
        out = dequantize(raw.to(device), qtype, (8, 256))
        assert out.device.type == device and out.shape == (8, 256) and out.dtype == torch.float32
        if device != "meta":
            assert torch.equal(out.cpu(), dequantize(raw, qtype, (8, 256))), qtype.name
