"""Each instruction-set path of the C++ kernels against the others, in one process: the integer-
activation group kernels, attention, silu/gelu and the tiled int8 layout give the AVX-512 floats
bit for bit on AVX2 (and the group kernels on the portable path too); the float GEMMs, whose lane
counts differ, stay within float rounding and batch-invariant on every path.

`brisk._C.set_isa` switches the level the kernels dispatch to (what BRISK_CPU_ISA sets at start-up);
each test puts it back."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import partial

import pytest
import torch

from brisk import kernels
from brisk.kernels.capability import LEVELS
from brisk.quant.base import tile_rows

pytestmark = pytest.mark.skipif(not kernels.CAPS.built or not hasattr(kernels._C, "set_isa"),
                                reason="the C++ kernels are not built")
HERE = [lv for lv in LEVELS if LEVELS.index(lv) <= LEVELS.index(kernels.CAPS.cpu_isa)] if kernels.CAPS.built else []


@contextmanager
def _switched(setter: Callable[[object], None], value: object, start_up: object) -> Iterator[None]:
    setter(value)
    try:
        yield
    finally:
        setter(start_up)


def isa(level: str) -> AbstractContextManager[None]:
    return _switched(kernels._C.set_isa, level, kernels.CAPS.isa)


def avx_vnni(on: bool) -> AbstractContextManager[None]:
    return _switched(kernels._C.set_avx_vnni, on, kernels.CAPS.avx_vnni)


def at_each(fn, levels: list[str]) -> dict[str, object]:
    """fn() at each level; where the CPU has AVX-VNNI, the avx2 level both with it ("avx2") and
    without it ("avx2-maddubs")."""
    out = {}
    for level in levels:
        with isa(level):
            if level == "avx2" and kernels._C.cpu_avx_vnni():
                with avx_vnni(False):
                    out["avx2-maddubs"] = fn()
                with avx_vnni(True):
                    assert kernels._C.avx_vnni()
                    out[level] = fn()
            else:
                out[level] = fn()
    return out


def _group_weights(out: int, inp: int, group: int, bits: int, tiled: bool):
    if bits == 4:
        q = torch.randint(0, 256, (out, inp // 2), dtype=torch.uint8)
        zero = (torch.randn(out, inp // group) * 0.1).half()
    else:
        q = torch.randint(-128, 128, (out, inp), dtype=torch.int8)  # -128 included: the AVX2 sign trick's edge
        zero = None
    scale = (torch.rand(out, inp // group) * 0.02 + 0.001).half()
    if tiled:
        q, scale = tile_rows(q, 16 if bits == 4 else 32), tile_rows(scale, 1)
        zero = None if zero is None else tile_rows(zero, 1)
    return q, scale, zero


@pytest.mark.parametrize("mode,bits", [("int8", 4), ("int16", 4), ("int8", 8), ("int16", 8)])
@pytest.mark.parametrize("group", [32, 64, 128])  # 1, 2 and 4 blocks a group: each an AVX2 flat loop
@pytest.mark.parametrize("tiled", [False, True])
def test_integer_activation_kernels_are_bit_identical_on_every_path(mode: str, bits: int, group: int,
                                                                    tiled: bool) -> None:
    torch.manual_seed(0)
    out = 64 if tiled else 38  # 38: a partial last tile (row-major only)
    q, scale, zero = _group_weights(out, 256, group, bits, tiled)
    x = torch.randn(15, 256) * 2
    x[1, 32:64] *= 40  # an outlier block with its own scale
    fn = getattr(kernels._C, kernels.ACT_KERNELS[mode])
    for rows in (15, 14, 13):  # x tiles of 8 (the wide kernels), 4 and then 3, 2 or 1
        got = at_each(partial(fn, x[:rows], q, scale, zero, group, bits, None, tiled), HERE)
        for level in got:  # AVX-VNNI and maddubs included where the CPU has AVX-VNNI
            assert torch.equal(got[level], got[HERE[-1]]), f"{level} differs from {HERE[-1]} at {rows} rows"


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, starts: torch.Tensor,
            kv_lens: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    out = torch.empty_like(q)
    kernels._C.paged_attention(out, q, k, v, tables, starts, kv_lens, scale, window)
    return out


def test_attention_is_bit_identical_on_avx2() -> None:
    if "avx2" not in HERE or "avx512" not in HERE:
        pytest.skip("needs a CPU with AVX-512 to compare against")
    torch.manual_seed(0)
    for heads, kv_heads, dim in ((9, 3, 64), (8, 1, 128), (4, 1, 256)):
        for dtype in (torch.float32, torch.bfloat16):
            nb, lens, news = 12, [1, 17, 100, 150], [1, 3, 1, 5]
            k = torch.randn(nb, kv_heads, dim, 16).to(dtype)
            v = torch.randn(nb, kv_heads, 16, dim).to(dtype)
            q = torch.randn(sum(news), heads, dim).to(dtype)
            tables = torch.stack([torch.randperm(nb).to(torch.int32) for _ in lens])
            starts = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=torch.int32)
            kv_lens = torch.tensor(lens, dtype=torch.int32)
            for window in (0, 20):
                got = at_each(partial(_attend, q, k, v, tables, starts, kv_lens, dim ** -0.5, window), ["avx512", "avx2"])
                assert torch.equal(got["avx2"], got["avx512"]), (heads, dim, dtype, window)


def test_silu_and_gelu_are_bit_identical_on_avx2() -> None:
    if "avx2" not in HERE or "avx512" not in HERE:
        pytest.skip("needs a CPU with AVX-512 to compare against")
    g = torch.randn(3, 2 * 1536) * 4
    g[0, :8] = torch.tensor([-100.0, -87.5, -87.3, -30.0, 0.0, -0.0, 1e-30, 90.0])  # exp's clamp and signs
    for fn in (partial(kernels._C.silu_mul, g), partial(kernels._C.act_mul, g, 1)):
        got = at_each(fn, ["avx512", "avx2"])
        assert torch.equal(got["avx2"], got["avx512"])
        with isa("scalar"):  # std::exp: within an ulp or two
            torch.testing.assert_close(fn(), got["avx512"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("level", HERE)
def test_float_and_int8_gemms_on_each_path(level: str) -> None:
    """Against torch in float64, a row alone equal to its batch result, and the tiled int8 layout
    equal to the row-major one, at every level."""
    torch.manual_seed(0)
    w, x = torch.randn(132, 200), torch.randn(7, 200)
    qi = torch.randint(-127, 128, (132, 256), dtype=torch.int8)
    s, xi = torch.rand(132), torch.randn(7, 256)
    with isa(level):
        y = kernels._C.small_gemm(x, w, None)
        yi = kernels._C.int8_gemm(xi, qi, s, None)
        yt = kernels._C.int8_gemm_tiled(xi, tile_rows(qi, 64), s, None)
        rows = [kernels._C.small_gemm(x[i:i + 1], w, None) for i in range(7)]
        one = kernels._C.gemv(x[:1], w, None)
    torch.testing.assert_close(y, (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(yi, ((xi.double() @ qi.double().T) * s.double()).float(), rtol=1e-5, atol=1e-3)
    assert torch.equal(yt, yi)
    assert all(torch.equal(r, y[i:i + 1]) for i, r in enumerate(rows)) and torch.equal(one, y[:1])


@pytest.mark.parametrize("bits", [4, 8])
def test_float_group_kernel_on_each_path(bits: int) -> None:
    """The float-activation group kernel: AVX2 (bit-identical to the portable loop) within float
    rounding of AVX-512, batch-invariant on each; its dequantized weights bit-identical everywhere."""
    torch.manual_seed(0)
    q, scale, zero = _group_weights(64, 256, 32, bits, tiled=True)
    x = torch.randn(6, 256)
    ref = kernels._C.group_dequantize(q, scale, zero, 32, bits, True)
    for level, weights in at_each(partial(kernels._C.group_dequantize, q, scale, zero, 32, bits, True), HERE).items():
        assert torch.equal(weights, ref), level  # the prompt path's weights: the same floats everywhere
    got = {}
    for level in HERE:
        with isa(level):
            got[level] = y = kernels._C.group_gemm(x, q, scale, zero, 32, bits, None, True)
            alone = kernels._C.group_gemm(x[3:4], q, scale, zero, 32, bits, None, True)
        torch.testing.assert_close(y, (x.double() @ ref.double().T).float(), rtol=1e-5, atol=1e-4)
        assert torch.equal(alone, y[3:4]), level
    if "avx2" in got:  # the AVX2 kernel is the portable loop's arithmetic on vectors
        assert torch.equal(got["avx2"], got["scalar"])


def test_w8a8_integers_are_the_same_on_every_path() -> None:
    """W8A8's quantizer and int8 x int8 kernel: AVX512-VNNI, AVX-VNNI, AVX2's vpmaddubsw form and the
    portable loop give the same integers (the definition's, summed in int64)."""
    torch.manual_seed(5)
    x = torch.randn(11, 192) * 3  # 11 rows: tiles of 8 or 4 x rows and single rows
    x[2, 0] = 127.0  # a = 1: the halves below are exact ties (round half to even)
    x[2, 1:5] = torch.tensor([2.5, -3.5, 0.5, -0.5])
    w = torch.randint(-128, 128, (37, 192), dtype=torch.int8)  # -128: the sign form's edge; 37 rows: tails
    want_q = torch.round(x / (x.abs().amax(dim=1, keepdim=True) / 127)).clamp(-127, 127)
    want = (want_q.long() + 128) @ w.long().T
    def run() -> tuple[torch.Tensor, torch.Tensor]:
        q = kernels.quantize_rows(x, True)[0]
        return q, kernels.int8_dot_u8s8(q, w)

    got = at_each(run, HERE)
    for level, (q, acc) in got.items():
        assert torch.equal(q.long() - 128, want_q.long()), level
        assert torch.equal(acc.long(), want), level


@pytest.mark.parametrize("rows", [1, 5, 9])
def test_ternary_gives_the_avx512_floats_on_every_path(rows: int) -> None:
    """The AVX2 path's two 8-lane halves and the portable loop's 16 lanes sum as the AVX-512 kernel's
    masked adds and reduction do: the same floats."""
    from brisk.quant.ternary import pack_planes

    torch.manual_seed(6)
    plus, minus = pack_planes(torch.randint(-1, 2, (21, 160), dtype=torch.int8))
    x, scale = torch.randn(rows, 160), torch.rand(21) + 0.5
    got = at_each(lambda: kernels._C.ternary_gemm(x, plus, minus, scale, None), HERE)
    for level, y in got.items():
        assert torch.equal(y, got[HERE[-1]]), level
