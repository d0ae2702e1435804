"""The GGUF block kernels (kernels/cpu_blocks.cpp): every type against its dequantized float
reference, batch invariance, stacked mixed-type segments, the same bits at every ISA."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from brisk import kernels
from brisk.loader.dequant import dequantize
from brisk.quant.gguf import BlockLinear
from brisk.quant.grouped import quantize_act_blocks

T = GGMLQuantizationType
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL, T.IQ4_XS, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
TILE_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL, T.IQ4_XS, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]  # with a tiled layout (kernels.block_tile)
# fp16 fields (d, dmin) of each block: random bytes elsewhere are valid blocks
FP16_AT = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.IQ4_NL: (0,),
           T.IQ4_XS: (0,), T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}

pytestmark = pytest.mark.skipif(not kernels.block_types(), reason="brisk._C without the block kernels")


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> torch.Tensor:
    """uint8 [rows, row bytes] of random blocks with finite, moderate fp16 scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at in FP16_AT[qtype]:
        b[:, at:at + 2] = (rng.standard_normal(n) * 0.02).astype(np.float16).view(np.uint8).reshape(n, 2)
    return torch.from_numpy(b.reshape(rows, -1))


def reference(x: torch.Tensor, blocks: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    w = dequantize(blocks, qtype, (blocks.shape[0], in_features))
    return F.linear(quantize_act_blocks(x, "int8").double(), w.double()).float()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 17, 64])
def test_every_type_matches_its_dequantized_reference(qtype: GGMLQuantizationType, m: int) -> None:
    assert int(qtype) in kernels.block_types()
    in_features, out = 512, 36
    blocks = random_blocks(qtype, out, in_features, seed=int(qtype))
    x = torch.randn(m, in_features, generator=torch.Generator().manual_seed(m))
    y = kernels.block_gemm(x, [blocks], [int(qtype)])
    ref = reference(x, blocks, int(qtype), in_features)
    scale = ref.abs().max().item()
    torch.testing.assert_close(y, ref, rtol=0, atol=2e-6 * scale * in_features ** 0.5)
    for i in range(m):  # each row exactly as it comes alone
        assert torch.equal(y[i:i + 1], kernels.block_gemm(x[i:i + 1], [blocks], [int(qtype)]))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_1, T.Q8_0, T.IQ4_NL], ids=lambda t: t.name)
def test_widths_that_are_not_whole_256_blocks(qtype: GGMLQuantizationType) -> None:
    blocks = random_blocks(qtype, 12, 96, seed=3)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0))
    ref = reference(x, blocks, int(qtype), 96)
    torch.testing.assert_close(kernels.block_gemm(x, [blocks], [int(qtype)]), ref, rtol=0,
                               atol=1e-5 * ref.abs().max().item())


def test_stacked_segments_of_mixed_types_and_bias() -> None:
    """A Q4_K_M q|k|v: q and k in Q4_K, v in Q6_K, one call."""
    q, k, v = random_blocks(T.Q4_K, 16, 256, 1), random_blocks(T.Q4_K, 8, 256, 2), random_blocks(T.Q6_K, 8, 256, 3)
    types = [int(T.Q4_K), int(T.Q4_K), int(T.Q6_K)]
    bias = torch.randn(32)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    y = kernels.block_gemm(x, [q, k, v], types, bias)
    parts = [kernels.block_gemm(x, [b], [t]) for b, t in zip((q, k, v), types)]
    assert torch.equal(y, torch.cat(parts, dim=1) + bias)
    layer = BlockLinear(list(zip(types, (q, k, v))), 256, bias, (16, 8, 8), torch.float32, tile=False)
    assert torch.equal(layer(x), y)
    tiled = BlockLinear(list(zip(types, (q, k, v))), 256, bias, (16, 8, 8), torch.float32)
    assert tiled.types == [kernels.TILED | t for t in types]  # the same sums, four rows a tile
    torch.testing.assert_close(tiled(x), y, rtol=0, atol=1e-5 * y.abs().max().item())
    assert torch.equal(layer.dequantize(), torch.cat([dequantize(b, t, (b.shape[0], 256)) for b, t in
                                                      zip((q, k, v), types)]))


@pytest.mark.parametrize("qtype", [T.Q5_K, T.Q5_0], ids=lambda t: t.name)  # Q5_0: tiled
def test_block_linear_torch_path_is_the_same_arithmetic(qtype: GGMLQuantizationType,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernels do not serve (another device, no extension) the module computes the same."""
    blocks = random_blocks(qtype, 8, 512, 4)
    layer = BlockLinear([(int(qtype), blocks)], 512, None, (8,), torch.float32)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2))
    fast = layer(x)
    monkeypatch.setattr("brisk.quant.gguf.block_kernel_supported", lambda *a: False)
    torch.testing.assert_close(layer(x), fast, rtol=0, atol=1e-5 * fast.abs().max().item())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_copies_made_a_chunk_at_a_time_equal_the_whole(qtype: GGMLQuantizationType,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A module that keeps a copy of a file tensor (tiled blocks; a Q4_1 / Q8_0 GroupLinear, made in
    the kernels' tiles at once where they read tiles) makes it a chunk of rows at a time and tells
    the loader of each chunk's rows, in order, so their file pages can go (COPY_CHUNK_BYTES): the
    same bytes as each part copied whole, and the same outputs. Two parts (q|k-like, stacked), of
    24 and 20 rows in chunks of 8: the second ends on a part chunk."""
    from brisk.quant import gguf as native
    from brisk.quant.base import tile_rows

    blocks = random_blocks(qtype, 44, 512, seed=int(qtype) + 7)
    segments = [(int(qtype), blocks[:24]), (int(qtype), blocks[24:])]
    seen: list[torch.Tensor] = []
    monkeypatch.setattr(native, "COPY_CHUNK_BYTES", 8 * blocks.shape[1])
    chunked = native.native_module(segments, 512, None, (24, 20), torch.float32, seen.append)
    assert chunked is not None
    if isinstance(chunked, native.GroupLinear):  # Q4_1, Q8_0
        tiled = kernels.group_kernel_tiles()
        whole = [native.to_group(t, rows) for t, rows in segments]  # row-major, each part at once
        q, scale, zero = (None if whole[0][i] is None else torch.cat([w[i] for w in whole]) for i in range(3))
        for got, want, width in ((chunked.qweight, q, chunked.tile_width), (chunked.scale, scale, 1),
                                 (chunked.zero, zero, 1)):
            if want is not None:
                assert torch.equal(got, tile_rows(want.contiguous(), width) if tiled else want)
        assert chunked.tiled == tiled
        ref = native.GroupLinear(q, scale, zero, 32, whole[0][3], None, (24, 20), torch.float32)
    else:
        ref = BlockLinear(segments, 512, None, (24, 20), torch.float32)  # tiled whole, if at all
        assert chunked.types == ref.types and all(torch.equal(a, b) for a, b in zip(chunked.blocks, ref.blocks))
    copied = isinstance(chunked, native.GroupLinear) or chunked.tiled_parts[0]
    chunks = [(0, 8), (8, 8), (16, 8), (24, 8), (32, 8), (40, 4)]
    assert [(r.data_ptr(), r.shape[0]) for r in seen] == (
        [(blocks[r0].data_ptr(), n) for r0, n in chunks] if copied else [])
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    assert torch.equal(chunked(x), ref(x))


K_TYPES = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]  # prompt work as integers (kernels.block_kgemm)


@pytest.mark.skipif(not kernels.block_dequantize_supported(), reason="the tiled float path needs AVX2")
@pytest.mark.parametrize("float_tiles,float_x", [(False, False), (True, False), (False, True)],
                         ids=["kgemm", "float-tiles", "float-x"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_many_rows_multiply_the_same_weights_in_floats(qtype: GGMLQuantizationType, float_tiles: bool, float_x: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Past BLOCK_KERNEL_MAX_ROWS (prompt chunks) without AMX the weight is made float a tile at a
    time: the dequantized weights times float x; K-quant tiles instead meet x in int8 per 128 columns
    (block_kgemm, the next test) unless float GEMMs are as fast here (kernels.float_prompt_tiles:
    Intel CPUs; forced both ways here) or the layer keeps float x (`float_x`: MLP down projections)."""
    from brisk.quant import gguf as native

    monkeypatch.setattr(native, "bf16_tiles_supported", lambda: False)
    monkeypatch.setattr(native, "float_prompt_tiles", lambda: float_tiles)
    blocks = random_blocks(qtype, 40, 512, seed=int(qtype) + 1)
    layer = BlockLinear([(int(qtype), blocks[:24]), (int(qtype), blocks[24:])], 512, torch.randn(40), (24, 16),
                        torch.float32)
    layer.float_x = float_x
    x = torch.randn(native.BLOCK_KERNEL_MAX_ROWS + 7, 512, generator=torch.Generator().manual_seed(5))
    w = dequantize(blocks, int(qtype), (40, 512))
    assert torch.allclose(kernels.block_dequantize(blocks, int(qtype), 512, 3, 40), w[3:], rtol=1e-6, atol=1e-7)
    xk = quantize_act_blocks(x, "int8", 128) if qtype in K_TYPES and not (float_tiles or float_x) else x
    ref = F.linear(xk.double(), w.double(), layer.bias.double()).float()
    torch.testing.assert_close(layer(x), ref, rtol=0, atol=1e-5 * ref.abs().max().item())


@pytest.mark.skipif(not kernels.CAPS.has("block_dequantize_bf16") or not kernels.block_dequantize_supported(),
                    reason="brisk._C without block_dequantize_bf16, or a CPU without AVX2")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_many_rows_in_bf16_tiles_where_amx_is(qtype: GGMLQuantizationType, monkeypatch: pytest.MonkeyPatch) -> None:
    """The AMX path of prompt work (taken where kernels.bf16_tiles_supported(); forced here, torch's
    bf16 GEMM runs on any CPU): every stored type's rows dequantized straight to bf16 with torch's
    rounding (the same bits as `.bfloat16()` of the float32 rows, from any first row), tiles of
    rows smaller than a part, and y = bf16(x) @ bf16(W)^T summed in float32, rounded to bf16."""
    from brisk.quant import gguf as native

    blocks = random_blocks(qtype, 40, 512, seed=int(qtype) + 3)
    w = dequantize(blocks, int(qtype), (40, 512))
    for r0, r1 in ((0, 40), (3, 40), (5, 6)):
        out = torch.empty(r1 - r0, 512, dtype=torch.bfloat16)
        kernels.block_dequantize_bf16(blocks, int(qtype), 512, r0, r1, out)
        assert torch.equal(out, w[r0:r1].bfloat16()), (r0, r1)
    monkeypatch.setattr(native, "bf16_tiles_supported", lambda: True)
    monkeypatch.setattr(native, "BF16_TILE_BYTES", 2 * 512 * 8)  # 8-row tiles: parts of 24 and 16 rows
    layer = BlockLinear([(int(qtype), blocks[:24]), (int(qtype), blocks[24:])], 512, torch.randn(40), (24, 16),
                        torch.float32)
    x = torch.randn(native.BLOCK_KERNEL_MAX_ROWS + 7, 512, generator=torch.Generator().manual_seed(5))
    ref = F.linear(x.bfloat16().double(), w.bfloat16().double()).float()
    got = layer(x) - layer.bias
    torch.testing.assert_close(got, ref, rtol=2 ** -7, atol=1e-5 * ref.abs().max().item())


@pytest.mark.skipif(not kernels.CAPS.has("block_dequantize_bf16") or not kernels.block_dequantize_supported(),
                    reason="brisk._C without block_dequantize_bf16, or a CPU without AVX2")
def test_bf16_tiles_give_a_row_the_same_numbers_in_any_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's bf16 GEMM changes a row's numbers with the number of rows beside it; the chunks of
    a fixed row count keep every row's output the same in any batch and at any place in it."""
    from brisk.quant import gguf as native

    monkeypatch.setattr(native, "bf16_tiles_supported", lambda: True)
    blocks = random_blocks(T.Q4_K, 512, 1536, seed=11)  # whole batches of 65-200 rows at once differ here
    layer = BlockLinear([(int(T.Q4_K), blocks)], 1536, None, (512,), torch.float32)
    x = torch.randn(300, 1536, generator=torch.Generator().manual_seed(12))
    y = layer(x)
    perm = torch.randperm(300, generator=torch.Generator().manual_seed(13))
    assert torch.equal(layer(x[perm]), y[perm])
    for m in (65, 127, 129, 200):
        assert torch.equal(layer(x[300 - m:]), y[300 - m:]), m


def test_bad_bf16_dequantize_buffers_are_a_clear_error() -> None:
    if not kernels.CAPS.has("block_dequantize_bf16"):
        pytest.skip("brisk._C without block_dequantize_bf16")
    blocks = random_blocks(T.Q4_K, 8, 256, seed=1)
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        kernels.block_dequantize_bf16(blocks, int(T.Q4_K), 256, 0, 8, torch.empty(8, 256))
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        kernels.block_dequantize_bf16(blocks, int(T.Q4_K), 256, 0, 8, torch.empty(7, 256, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="rows out of range"):
        kernels.block_dequantize_bf16(blocks, int(T.Q4_K), 256, 4, 9, torch.empty(5, 256, dtype=torch.bfloat16))


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 3, 65, 130])
def test_k_quant_prompt_gemm_matches_its_reference(qtype: GGMLQuantizationType, m: int) -> None:
    """block_kgemm: K-quant tiles times x rounded to int8 per 128 columns, each half block's sum an exact
    integer: the dequantized weights times that x, each segment in its own columns, the others left
    alone, each row exactly as it comes alone (odd counts run the one-row tail)."""
    cols = 768
    blocks = random_blocks(qtype, 40, cols, seed=int(qtype) + 3)
    qt, tiles = kernels.block_tile(blocks, int(qtype))
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m)) * 3
    x[0, :128] = 0  # a zero run: a = 0
    y = torch.full((m, 50), 7.0)
    kernels.block_kgemm(x, [(qt, tiles[:12], 2), (qt, tiles[12:], 20)], y)
    w = dequantize(blocks, int(qtype), (40, cols))
    ref = F.linear(quantize_act_blocks(x, "int8", 128).double(), w.double()).float()
    assert torch.equal(y[:, :2], torch.full((m, 2), 7.0)) and torch.equal(y[:, 14:20], torch.full((m, 6), 7.0))
    got = torch.cat([y[:, 2:14], y[:, 20:48]], 1)
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-6 * ref.abs().max().item() * cols ** 0.5)
    for i in (0, m - 1):
        alone = torch.zeros(1, 40)
        kernels.block_kgemm(x[i:i + 1], [(qt, tiles, 0)], alone)
        assert torch.equal(alone, got[i:i + 1])


def test_k_quant_prompt_gemm_refuses_other_types() -> None:
    blocks = random_blocks(T.Q5_0, 8, 256, seed=1)
    qt, tiles = kernels.block_tile(blocks, int(T.Q5_0))
    with pytest.raises(RuntimeError, match="no K-quant tile"):
        kernels.block_kgemm(torch.randn(3, 256), [(qt, tiles, 0)], torch.empty(3, 8))
    qt, tiles = kernels.block_tile(random_blocks(T.Q4_K, 8, 256, seed=1), int(T.Q4_K))
    with pytest.raises(RuntimeError, match="fit y's columns"):
        kernels.block_kgemm(torch.randn(3, 256), [(qt, tiles, 4)], torch.empty(3, 8))


@pytest.mark.parametrize("qtype", TILE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 17, 64])
def test_tiles_match_the_dequantized_reference(qtype: GGMLQuantizationType, m: int) -> None:
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 / IQ4_NL / IQ4_XS / Q2_K ... Q6_K repacked four rows at a time (kernels.block_tile): the
    same bytes, the file's rows back from it, the tile kernel against the dequantized weights, each row as it
    comes alone."""
    cols = _isa_cols(qtype)
    blocks = random_blocks(qtype, 36, cols, seed=11)
    tiled_type, tiles = kernels.block_tile(blocks, int(qtype))
    # Q3_K / Q4_K / Q5_K / IQ4_XS tiles hold their 6-bit scales unpacked: 16 (IQ4_XS 8) bytes a row's block, not 12 (6)
    grown = (cols // 256) * {T.Q3_K: 4, T.Q4_K: 4, T.Q5_K: 4, T.IQ4_XS: 2}.get(qtype, 0)
    assert tiled_type == kernels.TILED | int(qtype) and tiles.shape == (36, blocks.shape[1] + grown)
    assert not torch.equal(tiles[:, :blocks.shape[1]], blocks)
    if qtype in (T.Q2_K, T.Q6_K):  # their tiles move whole bytes (Q5_0's fifth bits move bit by bit)
        assert torch.equal(tiles.flatten().sort().values, blocks.flatten().sort().values)
    untiled_type, back = kernels.block_untile(tiles, tiled_type)
    assert untiled_type == int(qtype) and torch.equal(back, blocks)
    if kernels.block_dequantize_supported() and m == 1:  # rows from mid-tile to mid-tile
        w = dequantize(blocks, int(qtype), (36, cols))
        assert torch.equal(kernels.block_dequantize(tiles, tiled_type, cols, 3, 33), w[3:33])
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    y = kernels.block_gemm(x, [tiles], [tiled_type])
    ref = reference(x, blocks, int(qtype), cols)
    torch.testing.assert_close(y, ref, rtol=0, atol=2e-6 * ref.abs().max().item() * cols ** 0.5)
    for i in range(m):
        assert torch.equal(y[i:i + 1], kernels.block_gemm(x[i:i + 1], [tiles], [tiled_type]))


def test_block_linear_tiles_rows_in_fours() -> None:
    """Q4_0 / Q5_0 / Q5_1 parts with rows in fours are tiled, others keep the file's layout; a tiled part that
    starts off a multiple of 4 in a stacked weight (rows split between threads mid-tile) gives the
    same numbers as the file's layout; dequantize and token rows read the file's values."""
    a, b, c = random_blocks(T.Q5_0, 8, 256, 1), random_blocks(T.Q8_0, 2, 256, 2), random_blocks(T.Q4_0, 12, 256, 3)
    parts = [(int(T.Q5_0), a), (int(T.Q8_0), b), (int(T.Q4_0), c), (int(T.Q5_1), random_blocks(T.Q5_1, 4, 256, 6))]
    layer = BlockLinear(parts, 256, None, (8, 2, 12, 4), torch.float32)
    plain = BlockLinear(parts, 256, None, (8, 2, 12, 4), torch.float32, tile=False)
    assert layer.types == [kernels.Q5_0X4, int(T.Q8_0), kernels.Q4_0X4, kernels.Q5_1X4]
    assert layer.tiled_parts == [True, False, True, True]
    assert plain.types == [int(T.Q5_0), int(T.Q8_0), int(T.Q4_0), int(T.Q5_1)]
    assert "Q5_0x4+Q8_0+Q4_0x4+Q5_1x4" in repr(layer)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(4))
    ref = reference(x, a, int(T.Q5_0), 256)
    torch.testing.assert_close(layer(x)[:, :8], ref, rtol=0, atol=2e-6 * ref.abs().max().item() * 16)
    torch.testing.assert_close(layer(x), plain(x), rtol=0, atol=1e-5 * plain(x).abs().max().item())
    for i in range(6):
        assert torch.equal(layer(x)[i:i + 1], layer(x[i:i + 1]))
    assert torch.equal(layer.dequantize(), plain.dequantize())
    odd = BlockLinear([(int(T.Q5_0), random_blocks(T.Q5_0, 6, 256, 5))], 256, None, (6,), torch.float32)
    assert odd.types == [int(T.Q5_0)]
    head = BlockLinear([(int(T.Q4_0), c)], 256, None, (12,), torch.float32)
    ids = torch.tensor([11, 0, 5, 5, 2])
    assert torch.equal(head.dequantize_rows(ids), dequantize(c, int(T.Q4_0), (12, 256))[ids])


def test_activations_round_half_to_even_at_every_level() -> None:
    """x's int8 blocks (every ISA's quantize_block): ties go to even, the block's largest value maps
    to 127, a zero block stays zero. Read back through an identity of Q8_0 rows (d = 1)."""
    rows = np.zeros((32, 2, 34), dtype=np.uint8)
    rows[:, :, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    for i in range(32):
        rows[i, 0, 2 + i] = 1
    weight = torch.from_numpy(rows.reshape(32, 68))
    x = torch.zeros(1, 64)
    x[0, :32] = torch.tensor([127.0, -127.0] + [k + 0.5 for k in range(-15, 15)])  # a = 1: x / a exact
    y = kernels.block_gemm(x, [weight], [int(T.Q8_0)])
    assert y[0].tolist() == torch.round(x[0, :32]).tolist()  # torch.round: half to even
    assert torch.equal(kernels.block_gemm(torch.zeros(1, 64), [weight], [int(T.Q8_0)]), torch.zeros(1, 32))


def test_bad_row_bytes_are_a_clear_error() -> None:
    blocks = random_blocks(T.Q4_K, 4, 512, 0)[:, :-1].contiguous()
    with pytest.raises(RuntimeError, match="takes 288 bytes, got 287"):
        kernels.block_gemm(torch.randn(1, 512), [blocks], [int(T.Q4_K)])
    with pytest.raises(RuntimeError, match="has no block kernel"):
        kernels.block_gemm(torch.randn(1, 512), [blocks], [int(T.IQ2_XS)])


def _isa_cols(qtype: GGMLQuantizationType) -> int:
    """Columns of the cross-ISA check: an odd count of 32-blocks (the AVX2 loop takes them in pairs)."""
    return 544 if GGML_QUANT_SIZES[qtype][0] == 32 else 512


_ISA_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from test_blocks import TILE_TYPES, TYPES, T, _isa_cols, random_blocks
from brisk import kernels
out = {{}}
for t in TYPES:
    cols = _isa_cols(t)
    b = random_blocks(t, 12, cols, int(t))
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(int(t)))
    out[t.name] = kernels.block_gemm(x, [b], [int(t)]).numpy().tobytes().hex()
for t in TILE_TYPES:
    cols = _isa_cols(t)
    qt, tiles = kernels.block_tile(random_blocks(t, 12, cols, 7), int(t))
    out[t.name + "x4"] = kernels.block_gemm(torch.randn(5, cols, generator=torch.Generator().manual_seed(7)), [tiles], [qt]).numpy().tobytes().hex()
for t in (T.Q3_K, T.Q4_K, T.Q6_K):
    qt, tiles = kernels.block_tile(random_blocks(t, 12, 512, 9), int(t))
    y = torch.zeros(5, 12)
    kernels.block_kgemm(torch.randn(5, 512, generator=torch.Generator().manual_seed(9)), [(qt, tiles, 0)], y)
    out[t.name + "kgemm"] = y.numpy().tobytes().hex()
print(json.dumps({{"isa": kernels.CAPS.isa, "avx_vnni": kernels.CAPS.avx_vnni, "out": out}}))
"""


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_every_isa_gives_the_same_bits(isa: str) -> None:
    if kernels.CAPS.cpu_isa == "scalar" or (isa == "avx2" and kernels.CAPS.cpu_isa == "avx2" and
                                            kernels.CAPS.isa == "avx2"):
        pytest.skip("no higher ISA here to compare against")
    here = os.path.dirname(__file__)
    script = _ISA_SCRIPT.format(tests=here)
    got = json.loads(subprocess.run([sys.executable, "-c", script], env={**os.environ, "BRISK_CPU_ISA": isa},
                                    check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    assert got["isa"] == isa
    for t in TYPES:
        cols = _isa_cols(t)
        b = random_blocks(t, 12, cols, int(t))
        x = torch.randn(5, cols, generator=torch.Generator().manual_seed(int(t)))
        assert kernels.block_gemm(x, [b], [int(t)]).numpy().tobytes().hex() == got["out"][t.name], t.name
    for t in TILE_TYPES:
        cols = _isa_cols(t)
        qt, tiles = kernels.block_tile(random_blocks(t, 12, cols, 7), int(t))
        y = kernels.block_gemm(torch.randn(5, cols, generator=torch.Generator().manual_seed(7)), [tiles], [qt])
        assert y.numpy().tobytes().hex() == got["out"][t.name + "x4"], t.name
    for t in (T.Q3_K, T.Q4_K, T.Q6_K):
        qt, tiles = kernels.block_tile(random_blocks(t, 12, 512, 9), int(t))
        y = torch.zeros(5, 12)
        kernels.block_kgemm(torch.randn(5, 512, generator=torch.Generator().manual_seed(9)), [(qt, tiles, 0)], y)
        assert y.numpy().tobytes().hex() == got["out"][t.name + "kgemm"], t.name


def test_avx_vnni_gives_the_bits_of_maddubs_and_madd() -> None:
    """Where the CPU has AVX-VNNI, the avx2 level's block kernels use its vpdpbusd (default) and give
    the bits of their maddubs + madd form (BRISK_AVX_VNNI=0): the same integers, the same floats."""
    if not kernels.CAPS.built or not kernels._C.cpu_avx_vnni():
        pytest.skip("this CPU has no AVX-VNNI")
    script = _ISA_SCRIPT.format(tests=os.path.dirname(__file__))
    runs = [json.loads(subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True,
                                      env={**os.environ, "BRISK_CPU_ISA": "avx2", "BRISK_AVX_VNNI": v}
                                      ).stdout.strip().splitlines()[-1]) for v in ("0", "1")]
    assert [r["avx_vnni"] for r in runs] == [False, True] and runs[0]["isa"] == runs[1]["isa"] == "avx2"
    assert runs[0]["out"] == runs[1]["out"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_block_linear_on_cuda_gives_the_cpu_numbers_from_the_files_layout() -> None:
    """Moved to a GPU, tiled parts go back to the file's layout once (tiles serve the CPU kernels);
    the forward there is the same arithmetic (int8 activation blocks, dequantized weight), the
    embedding and head lookups read the file's values."""
    from brisk.quant.gguf import BlockEmbedding

    a, b, c = random_blocks(T.Q5_0, 8, 256, 1), random_blocks(T.Q6_K, 4, 256, 2), random_blocks(T.Q4_0, 12, 256, 3)
    parts = [(int(T.Q5_0), a), (int(T.Q6_K), b), (int(T.Q4_0), c)]
    bias = torch.randn(24)
    layer = BlockLinear(parts, 256, bias, (8, 4, 12), torch.float32)
    assert layer.tiled_parts == [True, True, True]
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4))
    want = layer(x)
    gpu = layer.to("cuda")
    assert gpu.types == [int(T.Q5_0), int(T.Q6_K), int(T.Q4_0)] and all(r.is_cuda for r in gpu.blocks)
    assert torch.equal(gpu.blocks[0].cpu(), a) and torch.equal(gpu.blocks[2].cpu(), c)
    got = gpu(x.cuda()).cpu()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    ref = torch.cat([reference(x, blk, int(t), 256) for t, blk in parts], dim=1) + bias
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    back = gpu.to("cpu")  # tiled again for the CPU kernels: the same bits as before the trip
    assert back.tiled_parts == [True, True, True] and torch.equal(back(x), want)
    head = BlockLinear([(int(T.Q4_0), c)], 256, None, (12,), torch.float32).to("cuda")
    ids = torch.tensor([11, 0, 5, 5, 2], device="cuda")
    assert torch.equal(head.dequantize_rows(ids).cpu(), dequantize(c, int(T.Q4_0), (12, 256))[ids.cpu()])
    emb = BlockEmbedding(int(T.Q6_K), random_blocks(T.Q6_K, 10, 256, 6), 256, torch.bfloat16).to("cuda")
    rows = emb(torch.tensor([[3, 9]], device="cuda"))
    assert rows.shape == (1, 2, 256) and rows.dtype == torch.bfloat16 and rows.is_cuda
