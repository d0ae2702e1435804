"""W8A8 (integer matmuls, SmoothQuant) and ternary (BitNet absmean, bit planes): exact integer
results on every path, packing round trips, and the kernels against the references."""

from __future__ import annotations

import pytest
import torch

from brisk import kernels
from brisk.config import QuantConfig
from brisk.model.layers import Linear
from brisk.quant.ternary import (
    TernaryLinear,
    pack_planes,
    quantize_absmean,
    unpack_planes,
)
from brisk.quant.w8a8 import W8A8Linear, quantize_tokens, smooth_scales

needs_int8_kernel = pytest.mark.skipif(not kernels.CAPS.has("int8_dot_u8s8"), reason="the C++ kernels are not built")


def _linear(in_features: int = 128, out: tuple[int, ...] = (40, 24), bias: bool = True) -> Linear:
    torch.manual_seed(0)
    lin = Linear(in_features, out, bias=bias)
    lin.weight.data.normal_(0, 0.1)
    if bias:
        lin.bias.data.normal_(0, 0.1)
    return lin


def _w8a8_reference(q: W8A8Linear, x: torch.Tensor) -> torch.Tensor:
    """The integer definition, summed in int64."""
    xq, a = quantize_tokens(x.float())
    acc = xq.long() @ q.qweight.long().T
    return acc.float() * a[:, None] * q.scale + (q.bias if q.bias is not None else 0)


@pytest.mark.parametrize("rows", [1, 5, 32, 33, 200])
def test_w8a8_equals_its_integer_definition_on_every_path(rows: int) -> None:
    q = W8A8Linear.from_linear(_linear())
    x = torch.randn(rows, 128) * 3
    torch.testing.assert_close(q(x), _w8a8_reference(q, x), rtol=1e-6, atol=1e-6)
    # and stays close to the float layer (int8 both sides)
    ref = x @ _linear().weight.T + _linear().bias
    assert (q(x) - ref).abs().max() < 0.03 * ref.abs().max()


@pytest.mark.parametrize("packed", [False, True])
def test_w8a8_rows_are_the_same_alone_or_in_any_batch(packed: bool) -> None:
    q = W8A8Linear.from_linear(_linear())
    if packed:  # from 17 rows: oneDNN on the packed weight instead of torch._int_mm
        assert q.pack() == (128 * 64 if kernels.HAVE_ONEDNN_QLINEAR else 0)
    x = torch.randn(40, 128) * 2
    alone = torch.cat([q(x[i:i + 1]) for i in range(40)])  # the VNNI kernel where there is one
    assert torch.equal(q(x[:16]), alone[:16]) and torch.equal(q(x[:17]), alone[:17])
    assert torch.equal(q(x), alone)
    torch.testing.assert_close(q(x), _w8a8_reference(q, x), rtol=1e-6, atol=1e-6)


@needs_int8_kernel
def test_the_int8_kernel_matches_the_integer_sum_exactly() -> None:
    torch.manual_seed(1)
    x = torch.randn(7, 192)
    w = torch.randint(-127, 128, (50, 192), dtype=torch.int8)
    xq_u8, a = kernels.quantize_rows(x, True)
    assert torch.equal(kernels.quantize_rows(x, False)[0], quantize_tokens(x)[0])
    xq, a_ref = quantize_tokens(x)
    assert torch.equal((xq_u8.int() - 128).to(torch.int8), xq) and torch.allclose(a, a_ref)
    acc = kernels.int8_dot_u8s8(xq_u8, w) - 128 * w.sum(dim=1, dtype=torch.int32)
    assert torch.equal(acc, (xq.int() @ w.int().T))
    with pytest.raises(ValueError, match="multiple of 64"):
        kernels.int8_dot_u8s8(torch.zeros(2, 96, dtype=torch.uint8), torch.zeros(4, 96, dtype=torch.int8))


@needs_int8_kernel  # the quantizer of the C++ path
@pytest.mark.parametrize("width", [192, 200, 7])
def test_the_cpu_quantizer_gives_torchs_integers(width: int) -> None:
    """The vectorized quantizer (16 columns at a time, then a scalar tail) against torch.round(x / a):
    halves round to even, a zero row, widths with and without a tail."""
    torch.manual_seed(3)
    x = torch.randn(5, width) * 3
    x[1] = 0.0
    x[2, 0] = 127.0  # a = 1 exactly: the halves below are exact ties
    x[2, 1:6] = torch.tensor([2.5, -3.5, 0.5, -0.5, 126.5])[: width - 1]
    for unsigned in (False, True):
        q, a = kernels.quantize_rows(x, unsigned)
        ref, a_ref = quantize_tokens(x)
        assert torch.equal(a, a_ref)
        assert torch.equal(q.int() - 128 if unsigned else q.int(), ref.int())
    assert quantize_tokens(x)[0][2, 1:5].tolist() == [2, -4, 0, 0][: width - 1]


def test_smoothing_moves_activation_outliers_into_the_weights() -> None:
    torch.manual_seed(2)
    lin = _linear(bias=False)
    x = torch.randn(64, 128)
    x[:, 5] *= 60  # one outlier channel
    t = smooth_scales(lin.weight, x.abs().amax(dim=0))
    assert t[5] > 4 * t.median()
    plain = W8A8Linear.from_linear(lin)
    scaled = Linear(128, (40, 24))
    scaled.weight.data = lin.weight * t
    smooth = W8A8Linear.from_linear(scaled)
    smooth.set_input_scale(1 / t)
    ref = x @ lin.weight.T
    assert (smooth(x) - ref).pow(2).mean() < 0.5 * (plain(x) - ref).pow(2).mean()


def test_ternary_packing_round_trips_and_absmean_is_bitnets() -> None:
    torch.manual_seed(3)
    w = torch.randn(8, 64)
    t, gamma = quantize_absmean(w)
    assert set(t.unique().tolist()) <= {-1, 0, 1}
    torch.testing.assert_close(gamma, w.abs().mean(dim=1))
    plus, minus = pack_planes(t)
    assert plus.shape == (8, 8) and torch.equal(unpack_planes(plus, minus), t)
    assert int(plus[0, 0]) == sum(1 << b for b in range(8) if t[0, b] == 1)  # bit b = column b
    with pytest.raises(ValueError, match="divisible by 16"):
        pack_planes(torch.zeros(2, 40, dtype=torch.int8))


@pytest.mark.parametrize("rows", [1, 4, 9, 200])
def test_ternary_linear_equals_its_dequantized_weight(rows: int) -> None:
    q = TernaryLinear.from_linear(_linear())
    x = torch.randn(rows, 128)
    torch.testing.assert_close(q(x), x @ q.dequantize().T + q.bias, atol=2e-5, rtol=1e-5)


def test_methods_are_known_to_the_config() -> None:
    assert QuantConfig("w8a8", calibration="t.txt").describe() == "w8a8 smoothquant"
    assert QuantConfig("ternary").describe() == "ternary"
    with pytest.raises(ValueError, match="calibration applies to int4"):
        QuantConfig("ternary", calibration="t.txt")
