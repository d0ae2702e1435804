"""Group-quantized weights (int4 and the GGUF blocks): exact packing, the kernels against the
dequantized reference, GPTQ rounding, and clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from brisk import kernels
from brisk.config import QuantConfig
from brisk.loader.dequant import dequantize
from brisk.model.layers import Linear
from brisk.quant import apply
from brisk.quant.gguf import NATIVE, to_group
from brisk.quant.gptq import gptq_quantize
from brisk.quant.grouped import (
    GroupLinear,
    dequantize_reference,
    group_params,
    pack_nibbles,
    quantize_rtn_4bit,
    unpack_nibbles,
)

needs_kernel = pytest.mark.skipif(not kernels.HAVE_CPU_GEMV or kernels.SMALL_GEMM_MAX_ROWS == 1,
                                  reason="needs the AVX-512 kernels")


def test_nibble_packing_round_trips_and_matches_gguf_order() -> None:
    q = torch.randint(0, 16, (5, 96), dtype=torch.uint8)
    packed = pack_nibbles(q)
    assert packed.shape == (5, 48) and torch.equal(unpack_nibbles(packed), q)
    # GGUF: byte j of a 32-column run = column j (low nibble) | column j + 16 (high nibble)
    assert int(packed[0, 3]) == int(q[0, 3]) | (int(q[0, 19]) << 4)


def test_rtn_error_is_at_most_half_a_step() -> None:
    torch.manual_seed(0)
    w = torch.randn(16, 128) * 0.05
    q, scale, zero = quantize_rtn_4bit(w, 64, search=False)
    deq = dequantize_reference(q, scale, zero, 64, 4)
    step = scale.repeat_interleave(64, dim=1)
    assert ((deq - w).abs() <= step / 2 + 1e-7).all()
    # values already on the grid come back exactly, with the clipping search too
    for search in (False, True):
        q2, s2, z2 = quantize_rtn_4bit(deq, 64, search=search)
        torch.testing.assert_close(dequantize_reference(q2, s2, z2, 64, 4), deq, rtol=0, atol=1e-7)


def test_clipping_search_never_loses_to_min_max_and_wins_on_outliers() -> None:
    torch.manual_seed(0)
    w = torch.randn(32, 256) * 0.05
    w[:, ::61] *= 3  # a few large weights per group: min/max spends the grid on them
    errors = {}
    for search in (False, True):
        q, scale, zero = quantize_rtn_4bit(w, 64, search=search)
        errors[search] = (dequantize_reference(q, scale, zero, 64, 4) - w).square().reshape(32, 4, 64).sum(-1)
    assert (errors[True] <= errors[False] * (1 + 1e-5)).all()
    assert errors[True].sum() < 0.9 * errors[False].sum()
    # a column weight moves the error to the columns that matter less
    heavy = torch.ones(64)
    heavy[::61] = 100.0
    s_plain, _ = group_params(w.reshape(32, 4, 64))
    s_heavy, _ = group_params(w.reshape(32, 4, 64), heavy)
    assert not torch.equal(s_plain, s_heavy)


def test_the_search_skips_clippings_only_where_a_grid_already_fits() -> None:
    from brisk.quant.grouped import CLIPS, _clipped, _pick, _q4_0_grid, _search

    torch.manual_seed(3)
    w = torch.randn(600, 64) * 0.05
    w[:, ::13] *= 3
    q, scale, zero = quantize_rtn_4bit(w[:200], 64, search=False)
    w[:200] = dequantize_reference(q, scale, zero, 64, 4)  # groups already on a min/max grid
    lo, hi = w.amin(-1), w.amax(-1)
    every = [_clipped(lo, hi - lo, a, b) for a in CLIPS for b in CLIPS] + [_q4_0_grid(w)]
    zeros = torch.zeros(600, dtype=torch.float16)
    for column_weight in (None, torch.rand(600, 64)):
        best_err, _, _ = _pick(w, column_weight, every, (torch.full((600,), float("inf")), zeros, zeros))
        scale, zero = _search(w, column_weight, symmetric=True)
        err, _, _ = _pick(w, column_weight, [(scale, zero)], (torch.full((600,), float("inf")), zeros, zeros))
        assert torch.equal(err, best_err)  # the exhaustive search's least error, every group
        assert (err[:200] == 0).all()


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_dequantization_equals_the_reference(bits: int) -> None:
    torch.manual_seed(1)
    lin = GroupLinear.from_weight(torch.randn(40, 128), None, 32, bits)
    ref = dequantize_reference(lin.qweight, lin.scale, lin.zero, 32, bits)
    assert torch.equal(lin.dequantize(), ref)  # q * fp16 scale + fp16 zero: exact in float64, one rounding


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 32)])
@pytest.mark.parametrize("rows", [1, 3, 8, 33, 200])
def test_group_linear_equals_its_dequantized_weight(bits: int, group: int, rows: int) -> None:
    torch.manual_seed(0)
    lin = Linear(128, (40, 24), bias=True)
    lin.weight.data.normal_(0, 0.1)
    lin.bias.data.normal_(0, 0.1)
    q = GroupLinear.from_linear(lin, group, bits)
    x = torch.randn(rows, 128)
    torch.testing.assert_close(q(x), x @ q.dequantize().T + lin.bias, atol=2e-5, rtol=1e-5)


@needs_kernel
def test_each_row_gets_the_same_result_alone_or_in_a_batch() -> None:
    torch.manual_seed(2)
    q = GroupLinear.from_weight(torch.randn(72, 192), None, 64, 4)
    x = torch.randn(31, 192)
    batch = q(x)
    assert all(torch.equal(batch[i:i + 1], q(x[i:i + 1])) for i in range(31))


def _random_blocks(kind: GGMLQuantizationType, rows: int, cols: int) -> np.ndarray:
    """Valid GGUF blocks: finite fp16 d (and m), random payload."""
    size = NATIVE[kind][0]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (rows, cols // 32, size), dtype=np.uint8)
    raw[..., 0:2] = np.frombuffer(rng.uniform(1e-3, 2e-2, (rows, cols // 32)).astype(np.float16).tobytes(),
                                  np.uint8).reshape(rows, cols // 32, 2)
    if kind == GGMLQuantizationType.Q4_1:
        raw[..., 2:4] = np.frombuffer(rng.uniform(-0.2, 0, (rows, cols // 32)).astype(np.float16).tobytes(),
                                      np.uint8).reshape(rows, cols // 32, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", list(NATIVE))
def test_gguf_blocks_give_exactly_the_loaders_dequantized_weights(kind: GGMLQuantizationType) -> None:
    raw = _random_blocks(kind, 6, 96)
    q, scale, zero, bits = to_group(int(kind), torch.from_numpy(raw))
    ours = dequantize_reference(q, scale, zero, 32, bits)
    assert torch.equal(ours, dequantize(raw, kind, (6, 96)))
    module = GroupLinear(q, scale, zero, 32, bits, None, (6,), torch.float32)
    assert torch.equal(module.dequantize(), ours)


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_round_to_nearest_at_group_32_lands_on_a_q4_blocks_own_grid(kind: GGMLQuantizationType) -> None:
    from gguf.quants import quantize

    rng = np.random.default_rng(5)
    x = (rng.standard_normal((24, 256)) * 0.05).astype(np.float32)
    x[:, ::37] *= 4  # groups whose largest |w| is on either side (Q4_0's d of either sign)
    stored = dequantize(quantize(x, kind), kind, (24, 256))
    q, scale, zero = quantize_rtn_4bit(stored, 32)
    assert torch.equal(dequantize_reference(q, scale, zero, 32, 4), stored)  # no second rounding
    if kind == GGMLQuantizationType.Q4_0:
        assert (scale < 0).any() and (scale > 0).any()  # Q4_0's own grid, d of either sign, was kept


def test_gptq_beats_round_to_nearest_on_correlated_inputs() -> None:
    torch.manual_seed(4)
    mix = torch.randn(96, 96) / 96**0.5
    x = torch.randn(2048, 96) @ (torch.eye(96) + 3 * mix)  # correlated channels: errors can cancel
    w = torch.randn(48, 96) * 0.05
    rtn = dequantize_reference(*quantize_rtn_4bit(w, 32), 32, 4)
    gptq = dequantize_reference(*gptq_quantize(w, x.T @ x / x.shape[0], 32), 32, 4)
    held_out = torch.randn(512, 96) @ (torch.eye(96) + 3 * mix)

    def err(weight_eff: torch.Tensor) -> float:
        return float(((held_out @ (weight_eff - w).T) ** 2).mean())

    assert err(gptq) < 0.9 * err(rtn)


def test_refit_finds_the_grid_of_weights_on_a_grid_and_never_adds_error() -> None:
    from brisk.quant.gptq import refit_groups

    torch.manual_seed(5)
    x = torch.randn(1024, 128) @ (torch.eye(128) + torch.randn(128, 128) / 12)
    xtx = x.T @ x / x.shape[0]
    q = torch.randint(0, 16, (40, 128), dtype=torch.uint8)
    scale = (torch.rand(40, 2) * 0.1 + 0.01).half()
    zero = (torch.randn(40, 2) * 0.1).half()
    w = dequantize_reference(pack_nibbles(q), scale, zero, 64, 4)  # exactly on the grid
    s2, z2 = refit_groups(w, xtx, q, (scale.float() * 1.3).half(), (zero.float() - 0.05).half(), 64)
    torch.testing.assert_close(s2, scale, atol=2e-3, rtol=2e-3)  # the grid the integers came from
    torch.testing.assert_close(z2, zero, atol=2e-3, rtol=2e-3)
    # on real GPTQ output every row's error under H is at most the static grid's
    w = torch.randn(40, 128) * 0.05
    packed, scale, zero = gptq_quantize(w, xtx, 64)
    qi = unpack_nibbles(packed)

    def row_err(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        d = w - dequantize_reference(packed, s, z, 64, 4)
        return ((d @ xtx) * d).sum(dim=1)

    s3, z3 = refit_groups(w, xtx, qi, scale, zero, 64)
    assert torch.equal(s3, scale) and torch.equal(z3, zero)  # gptq_quantize refitted already: a fixed point
    noisy_s, noisy_z = (scale.float() * 1.1).half(), zero
    s4, z4 = refit_groups(w, xtx, qi, noisy_s, noisy_z, 64)
    assert bool((row_err(s4, z4) <= row_err(noisy_s, noisy_z)).all())
    assert float(row_err(s4, z4).sum()) < 0.9 * float(row_err(noisy_s, noisy_z).sum())


def test_int4_apply_quantizes_body_in_4_bits_and_a_tied_head_in_8(tiny_llama) -> None:
    model = tiny_llama(tied=True)
    assert apply(model, QuantConfig("int4", group_size=32)) == 2 * 4 + 1
    assert not any(isinstance(m, Linear) for m in model.modules())
    assert model.layers[0].mlp.down_proj.bits == 4 and model.lm_head.bits == 8
    ids = torch.tensor([3, 60])
    assert torch.equal(model.embed_tokens(ids), model.lm_head.dequantize()[ids])


def test_gptq_through_apply_keeps_the_model_closer_than_round_to_nearest(tiny_llama) -> None:
    from brisk.runtime.model_runner import ModelRunner, SeqStep

    ids = list(range(1, 40))
    held_out = [(7 * i) % 60 + 2 for i in range(40)]
    torch.manual_seed(5)
    reference = tiny_llama(tied=False)
    before = ModelRunner(reference, 1, 64).execute([SeqStep(0, 0, held_out)])
    errors = {}
    for calibration in (None, "unused-here"):
        torch.manual_seed(5)  # the same random weights each time
        model = tiny_llama(tied=False)
        apply(model, QuantConfig("int4", group_size=32, calibration=calibration),
              calibration_ids=ids if calibration else None)
        assert all(m.input_scale is None for m in model.modules() if isinstance(m, GroupLinear))
        after = ModelRunner(model, 1, 64).execute([SeqStep(0, 0, held_out)])
        errors[calibration] = float((after - before).square().mean())
    assert errors["unused-here"] < errors[None]


def test_bad_options_are_clear_errors(tiny_llama) -> None:
    with pytest.raises(ValueError, match="group size 128 must be a multiple of 32 that divides the 576"):
        GroupLinear.from_weight(torch.randn(8, 576), None, 128, 4)
    with pytest.raises(ValueError, match="positive multiple of 32"):
        QuantConfig("int4", group_size=48)
    with pytest.raises(ValueError, match=r"calibration applies to int4 \(GPTQ\), w8a8"):
        QuantConfig("int8", calibration="x.txt")
    with pytest.raises(ValueError, match="unknown quantization option"):
        QuantConfig.parse("int4", '{"groupsize": 64}')
    with pytest.raises(ValueError, match="not valid JSON"):
        QuantConfig.parse("int4", "{group_size: 64}")
    with pytest.raises(ValueError, match="load a .gguf model"):
        apply(tiny_llama(tied=True), "gguf")


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 5, 9])
def test_tiled_group_weights_give_the_row_major_numbers_and_hide_their_layout(bits: int, rows: int) -> None:
    torch.manual_seed(2)
    lin = Linear(128, (40, 24), bias=True)
    lin.weight.data.normal_(0, 0.1)
    lin.bias.data.normal_(0, 0.1)
    q = GroupLinear.from_linear(lin, 64 if bits == 4 else 32, bits)
    row_major, state = q.qweight.clone(), {k: v.clone() for k, v in q.state_dict().items()}
    dequantized, ids = q.dequantize(), torch.tensor([0, 63, 7, 12])
    assert torch.equal(q.dequantize_rows(ids), dequantized[ids])  # row-major (before the first kernel call)
    with pytest.raises(RuntimeError, match="outside"):
        q.dequantize_rows(torch.tensor([64]))
    x = torch.randn(rows, 128)
    expected = kernels.group_gemm(x, row_major, q.scale, q.zero, q.group, bits, q.bias)
    assert torch.equal(q(x), expected) and q.tiled and not torch.equal(q.qweight, row_major)
    assert all(torch.equal(v, state[k]) for k, v in q.state_dict().items())
    assert torch.equal(q.dequantize(), dequantized) and torch.equal(q.qweight_rows(), row_major)
    assert torch.equal(q.dequantize_rows(ids), dequantized[ids])
    q.to(torch.bfloat16)
    assert not q.tiled and torch.equal(q.qweight, row_major)
