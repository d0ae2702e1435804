"""int8 and int16 activations for group-quantized weights (`activations: "int8" | "int16"`): the
VNNI kernels compute exactly the product of the block-quantized activations with the dequantized
weight, row by row whatever the batch, and the option is checked, saved and reloaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from brisk import LLM, SamplingParams, kernels
from brisk.config import QuantConfig
from brisk.loader.convert import quantize_to_dir
from brisk.model.layers import Linear
from brisk.quant.base import tile_rows
from brisk.quant.grouped import KERNEL_MAX_ROWS, GroupLinear, quantize_act_blocks

needs_vnni = pytest.mark.skipif(not kernels.group_qact_supported("int16", 4), reason="needs the integer-activation group kernels")


def test_block_quantization_is_round_half_even_of_x_over_max_by_127() -> None:
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-1, 1, 32)
    x[0, 5] = 1.27  # the block's max: a = 0.01, so 0.015 -> 1.5 -> 2 and 0.025 -> 2.5 -> 2 (ties to even)
    x[0, 6], x[0, 7] = 0.015, 0.025
    q = quantize_act_blocks(x)
    a = 1.27 / 127
    assert torch.equal(q[0, 5], torch.tensor(127 * a, dtype=torch.float32))
    assert torch.allclose(q[0, 6:8], torch.tensor([2 * a, 2 * a]))
    assert torch.equal(q[1], torch.zeros(64)) and torch.equal(q[0, 32:], torch.zeros(32))  # zero blocks stay zero
    assert ((q[0, :32] - x[0, :32]).abs() <= a / 2 + 1e-7).all()
    q16 = quantize_act_blocks(x, "int16")  # the same with 32767 levels: a rounding ~1e-5 of the block's max
    assert ((q16[0, :32] - x[0, :32]).abs() <= 1.27 / 32767 / 2 + 1e-7).all() and q16[0, 5] == x[0, 5]


def _layer(bits: int, group: int, out: int, in_features: int, mode: str = "int8") -> GroupLinear:
    torch.manual_seed(bits + group + out)
    lin = Linear(in_features, (out,), bias=True)
    lin.weight.data.normal_(0, 0.1)
    lin.bias.data.normal_(0, 0.1)
    q = GroupLinear.from_linear(lin, group, bits)
    q.activations = mode
    return q


@needs_vnni
@pytest.mark.parametrize("mode,bits,group", [("int8", 4, 32), ("int8", 4, 64), ("int8", 4, 128), ("int8", 8, 32),
                                             ("int8", 8, 64), ("int16", 4, 32), ("int16", 4, 64), ("int16", 4, 128),
                                             ("int16", 8, 32), ("int16", 8, 64)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 9])
@pytest.mark.parametrize("tiled", [True, False])
def test_vnni_kernel_equals_quantized_activations_times_the_weight(mode: str, bits: int, group: int, rows: int,
                                                                    tiled: bool) -> None:
    q = _layer(bits, group, 40 if tiled else 37, 256, mode)  # 37 rows: the last tile is partial (row-major only)
    x = torch.randn(rows, 256) * 3
    x[0, 40:72] *= 50  # an outlier block gets its own scale
    w = q.dequantize()
    qw, scale, zero = q.qweight, q.scale, q.zero
    if tiled:
        qw, scale = tile_rows(qw, q.tile_width), tile_rows(scale, 1)
        zero = None if zero is None else tile_rows(zero, 1)
    y = kernels.group_gemm_qact(x, qw, scale, zero, group, bits, mode, q.bias, tiled)
    expected = F.linear(quantize_act_blocks(x, mode).double(), w.double(), q.bias.double()).float()
    torch.testing.assert_close(y, expected, atol=2e-4, rtol=1e-5)
    # each row alone gives its batch result bit for bit
    assert all(torch.equal(y[i:i + 1], kernels.group_gemm_qact(x[i:i + 1], qw, scale, zero, group, bits, mode,
                                                                q.bias, tiled)) for i in range(rows))


@pytest.mark.parametrize("mode,bits", [("int8", 4), ("int8", 8), ("int16", 4), ("int16", 8)])
def test_quantized_activations_through_the_module_on_every_path(mode: str, bits: int) -> None:
    q = _layer(bits, 64 if bits == 4 else 32, 48, 128, mode)
    x = torch.randn(KERNEL_MAX_ROWS + 7, 128)
    expected = F.linear(quantize_act_blocks(x, mode), q.dequantize(), q.bias)
    torch.testing.assert_close(q(x[:5]), expected[:5], atol=2e-4, rtol=1e-5)  # the kernel (or its float twin)
    # past the kernel's rows a float GEMM: int8 activations stay rounded (the user's measured
    # choice), int16 ones only fed the integer kernel, so x goes in as is
    many = F.linear(quantize_act_blocks(x, "int8") if mode == "int8" else x, q.dequantize(), q.bias)
    assert torch.equal(q(x), many)
    q.activations = "float"
    assert not torch.equal(q(x[:5]), expected[:5])  # the option does change the input


def test_int16_activations_on_8_bit_weights_sum_exactly_at_the_extremes() -> None:
    """8-bit x int16 lanes sum 16 products of |q| <= 127 and |x| <= 32767 in int32 (|sum| < 2^26, exact);
    an all-extreme block's sum is 16 times an odd number, so its float is exact too, and all-extreme
    weights and activations give the float64 product."""
    q = _layer(8, 32, 8, 128, "int16")
    q.qweight.copy_(torch.where(torch.arange(128) % 3 == 0, -127, 127).to(torch.int8).expand(8, 128))
    q.scale.fill_(1.0)
    x = torch.where(torch.arange(128) % 2 == 0, -1.0, 1.0).expand(2, 128).contiguous()
    expected = F.linear(quantize_act_blocks(x, "int16").double(), q.dequantize().double(), q.bias.double()).float()
    assert torch.equal(q(x), expected)


def test_activation_option_is_checked() -> None:
    assert QuantConfig.parse("int4", {"activations": "int8"}).describe() == "int4 g64 gptq self a8"
    assert QuantConfig.parse("gguf", '{"activations": "int8"}').describe() == "gguf a8"
    assert QuantConfig.parse("int4", {"activations": "int16", "calibration": "none"}).describe() == "int4 g64 rtn a16"
    with pytest.raises(ValueError, match="activations must be one of float, int16, int8"):
        QuantConfig.parse("int4", {"activations": "int4"})
    with pytest.raises(ValueError, match="applies to int4 and gguf"):
        QuantConfig.parse("int8", {"activations": "int8"})


def test_a_saved_checkpoint_keeps_its_activations_and_a_load_may_change_them(gguf_path: Path, tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    folder = quantize_to_dir("smollm2-135m", QuantConfig.parse("int4", {"activations": "int8", "calibration": "none"}),
                             tmp_path / "q4")

    def no_search(*args: object) -> None:
        raise AssertionError("a saved checkpoint's load re-ran the clipping search (its values are replaced)")

    monkeypatch.setattr("brisk.quant.grouped._search", no_search)
    saved = LLM(str(folder), num_kv_blocks=64, max_model_len=256)
    assert saved.quantization.activations == "int8"
    assert {m.activations for m in saved.model.modules() if isinstance(m, GroupLinear)} == {"int8"}
    # naming the method without the option keeps the checkpoint's choice; naming it changes it
    same = LLM(str(folder), quantization="int4", num_kv_blocks=64, max_model_len=256)
    assert same.quantization.describe().endswith("a8")
    switched = LLM(str(folder), quantization="int4", quantization_config={"activations": "float"},
                   num_kv_blocks=64, max_model_len=256)
    assert {m.activations for m in switched.model.modules() if isinstance(m, GroupLinear)} == {"float"}
    params = SamplingParams(max_tokens=8, temperature=0.0)
    text = saved.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].text
    assert "Paris" in text
