"""int8 weight-only quantization: exact packing, the kernel against the dequantized reference,
the model through the engine, and clear errors."""

from __future__ import annotations

import pytest
import torch

from brisk import kernels
from brisk.model.layers import Linear
from brisk.quant import apply, check_method
from brisk.quant.base import tile_rows, untile_rows
from brisk.quant.int8 import Int8Linear, quantize_per_channel


def random_linear(in_features: int, output_sizes: tuple[int, ...], bias: bool, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    lin = Linear(in_features, output_sizes, bias=bias)
    lin.weight.data.normal_(0, 0.1)
    if bias:
        lin.bias.data.normal_(0, 0.1)
    return lin


def test_quantize_round_trip_is_exact_on_representable_weights() -> None:
    scale = torch.tensor([0.5, 0.01, 2.0])
    q = torch.randint(-127, 128, (3, 40), dtype=torch.int8)
    q[:, 0] = 127  # the row maximum fixes the scale
    w = q.float() * scale[:, None]
    q2, s2 = quantize_per_channel(w)
    assert torch.equal(q2, q) and torch.allclose(s2, scale)


@pytest.mark.parametrize("rows", [1, 2, 7, 32, 33, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_equals_its_dequantized_weight(rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    lin = Linear(96, (40, 24), bias=bias)
    lin.weight.data.normal_(0, 0.1)
    if bias:
        lin.bias.data.normal_(0, 0.1)
    q = Int8Linear.from_linear(lin)
    x = torch.randn(rows, 96)
    ref = x @ q.dequantize().T + (lin.bias if bias else 0)
    torch.testing.assert_close(q(x), ref, atol=2e-5, rtol=1e-5)
    # and the rounding error against the float weight is what int8 per channel allows
    assert (q.dequantize() - lin.weight).abs().max() <= q.scale.max() / 2 + 1e-7


def test_tiles_round_trip_and_hold_4_rows_of_64_columns_side_by_side() -> None:
    q = torch.randint(-127, 128, (8, 128), dtype=torch.int8)
    t = tile_rows(q, 64)
    assert torch.equal(untile_rows(t, 64), q)
    flat = t.reshape(-1)  # tile (g=0, c=1) starts at byte 256: rows 0..3, columns 64..127
    assert torch.equal(flat[256:512].view(4, 64), q[0:4, 64:128])


@pytest.mark.skipif(not (kernels.int8_gemm_supported(torch.zeros(4, 64, dtype=torch.int8)) and kernels.int8_kernel_tiles()),
                    reason="needs the AVX-512 tiled kernel")
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 128])
def test_tiled_kernel_gives_the_row_major_kernels_numbers_and_hides_its_layout(rows: int) -> None:
    lin = random_linear(192, (64, 32, 32), bias=True, seed=1)
    q = Int8Linear.from_linear(lin)
    row_major, state = q.qweight.clone(), {k: v.clone() for k, v in q.state_dict().items()}
    dequantized, ids = q.dequantize(), torch.tensor([0, 5, 127, 64, 3])
    x = torch.randn(rows, 192)
    expected = kernels.int8_gemm(x, row_major, q.scale, q.bias)
    assert torch.equal(q(x), expected) and q.tiled  # bit for bit: the same sums in the same order
    assert not torch.equal(q.qweight, row_major)  # really held tiled
    # what the rest of brisk sees is the row-major weight
    assert all(torch.equal(v, state[k]) for k, v in q.state_dict().items())
    assert torch.equal(q.dequantize(), dequantized) and torch.equal(q.qweight_rows(), row_major)
    assert torch.equal(q.dequantize_rows(ids), dequantized[ids])
    other = Int8Linear.from_linear(lin)
    other(x)
    other.load_state_dict(state)  # a row-major checkpoint into a tiled module
    assert not other.tiled and torch.equal(other(x), expected)
    q.to(torch.bfloat16)  # moving restores the row-major layout first
    assert not q.tiled and torch.equal(q.qweight, row_major)


def test_shapes_without_whole_tiles_stay_row_major() -> None:
    lin = Linear(96, (40, 24))  # 96 input columns: not whole 64-column tiles
    lin.weight.data.normal_(0, 0.1)
    q = Int8Linear.from_linear(lin)
    x = torch.randn(2, 96)
    torch.testing.assert_close(q(x), x @ q.dequantize().T, atol=2e-5, rtol=1e-5)
    assert not q.tiled


@pytest.mark.skipif(not kernels.HAVE_CPU_GEMV or kernels.SMALL_GEMM_MAX_ROWS == 1, reason="needs the AVX-512 kernel")
def test_int8_kernel_rejects_bad_input() -> None:
    q = torch.zeros(8, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="does not fit"):
        kernels.int8_gemm(torch.zeros(2, 15), q, torch.ones(8))


def test_apply_swaps_every_decoder_linear_and_the_model_still_runs(tiny_llama) -> None:
    model = tiny_llama(tied=False, layers=2, hidden=32)
    ids = torch.tensor([1, 5, 9, 3])
    from brisk.runtime.model_runner import ModelRunner, SeqStep

    before = ModelRunner(model, 1, 16).execute([SeqStep(0, 0, ids.tolist())])
    assert apply(model, "int8") == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the untied LM head
    assert not any(isinstance(m, Linear) for m in model.modules())
    after = ModelRunner(model, 1, 16).execute([SeqStep(0, 0, ids.tolist())])
    assert after.shape == before.shape and (after - before).abs().max() < 0.05 * before.abs().max()
    with pytest.raises(ValueError, match="unknown quantization method 'int3'"):
        check_method("int3")


def test_a_tied_head_is_quantized_and_lookups_read_it(tiny_llama) -> None:
    model = tiny_llama(tied=True, layers=1, hidden=32)
    h = torch.randn(3, 32)
    before = model.compute_logits(h)
    assert apply(model, "int8") == 4 + 1
    assert isinstance(model.lm_head, Int8Linear)
    ids = torch.tensor([0, 7, 63, 7])
    assert torch.equal(model.embed_tokens(ids), model.lm_head.dequantize()[ids])  # one copy of the matrix
    assert not any(p.numel() == 64 * 32 for p in model.parameters())  # the float embedding is gone
    after = model.compute_logits(h)
    torch.testing.assert_close(after, h @ model.lm_head.dequantize().T, atol=1e-5, rtol=1e-5)
    assert (after - before).abs().max() < 0.02 * before.abs().max()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_int8_linear_on_cuda_equals_its_dequantized_weight() -> None:
    lin = random_linear(96, (64,), bias=True)
    q = Int8Linear.from_linear(lin).to("cuda")
    x = torch.randn(5, 96, device="cuda")
    torch.testing.assert_close(q(x), x @ q.dequantize().T + lin.bias.cuda(), atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_weights_tiled_on_the_cpu_move_to_cuda_row_major() -> None:
    from brisk.quant.grouped import GroupLinear

    lin = random_linear(576, (960,), bias=True)
    for module in (Int8Linear.from_linear(lin), GroupLinear.from_linear(lin, 64, 4), GroupLinear.from_linear(lin, 32, 8)):
        x = torch.randn(3, 576)
        cpu = module(x)  # tiles where the CPU kernel runs
        module.to("cuda")
        assert not module.tiled
        torch.testing.assert_close(module(x.cuda()).cpu(), cpu, atol=1e-4, rtol=1e-4)
