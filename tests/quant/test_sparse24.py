"""2:4 sparse Linears: packing is exact, the kernel equals the dense masked weight for 1..64 rows
(float32 and int8 values, every ISA path), a row gives the same floats alone and in a batch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from brisk import kernels
from brisk.model.layers import Linear
from brisk.quant.sparse24 import KERNEL_MAX_ROWS, Sparse24Linear, dense_24, pack_24, select_24

needs_kernel = pytest.mark.skipif(not kernels.CAPS.has("sparse24_gemm"), reason="brisk._C without the 2:4 kernel")


def _linear(out: int, n: int, bias: bool = True, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    lin = Linear(n, (out,), bias)
    with torch.no_grad():
        lin.weight.normal_()
        if bias:
            lin.bias.normal_()  # type: ignore[union-attr]
    return lin


def test_selection_keeps_the_two_largest_scores_of_every_group() -> None:
    w = torch.randn(8, 64)
    norms = torch.rand(64) + 0.1
    keep = select_24(w, norms)
    groups = keep.view(8, 16, 4)
    assert bool((groups.sum(-1) == 2).all())
    score = (w.abs() * norms).view(8, 16, 4)
    kept_min = score.masked_fill(~groups, float("inf")).amin(-1)
    dropped_max = score.masked_fill(groups, -float("inf")).amax(-1)
    assert bool((kept_min >= dropped_max).all())
    with pytest.raises(ValueError, match="divisible by 4"):
        select_24(torch.randn(4, 30), None)


@pytest.mark.parametrize("n", [64, 576, 100])
def test_packing_round_trips_exactly(n: int) -> None:
    w = torch.randn(12, n)
    keep = select_24(w, None)
    values, meta = pack_24(w, keep)
    assert values.shape == (12, -(-n // 32) * 16) and meta.dtype == torch.int32
    assert torch.equal(dense_24(values, meta, None, n), w * keep)
    if kernels.CAPS.has("sparse24_dense"):
        assert torch.equal(kernels.sparse24_dense(values, meta, None, n), w * keep)


@needs_kernel
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("n", [576, 1536, 100])
def test_kernel_equals_the_dense_masked_weight(int8: bool, n: int) -> None:
    calib = torch.randn(256, n)
    module = Sparse24Linear.from_linear(_linear(40, n), calib.T @ calib / 256, int8=int8)
    dense = dense_24(module.values, module.meta, module.scale, n)
    x = torch.randn(64, n)
    for rows in (1, 2, 3, 5, 8, 16, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 64):
        got = module(x[:rows])  # up to KERNEL_MAX_ROWS the sparse kernel; more: the dense weight through oneDNN
        want = x[:rows] @ dense.T + module.bias
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (rows, float((got - want).abs().max()))


def test_sparsegpt_output_error_is_below_magnitude_selection() -> None:
    """On the calibration inputs themselves, SparseGPT's kept-and-updated weights reproduce the dense
    output better than keeping the largest weights of each group (and keep exactly 2 of 4)."""
    torch.manual_seed(1)
    lin = _linear(64, 256, bias=False)
    # correlated input columns of uneven scales, as in a model: what SparseGPT's update exploits
    x = (torch.randn(512, 64) @ torch.randn(64, 256) + 0.1 * torch.randn(512, 256)) * torch.linspace(0.2, 3.0, 256)
    sparse = Sparse24Linear.from_linear(lin, x.T @ x / 512)
    magnitude = Sparse24Linear.from_linear(lin)
    want = x @ lin.weight.T
    errors = [float((x @ dense_24(m.values, m.meta, None, 256).T - want).pow(2).mean()) for m in (sparse, magnitude)]
    assert errors[0] < 0.5 * errors[1], errors
    assert bool(((dense_24(sparse.values, sparse.meta, None, 256) != 0).view(64, 64, 4).sum(-1) <= 2).all())


@needs_kernel
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("n", [576, 100])
def test_a_row_gives_the_same_floats_alone_and_in_a_batch(int8: bool, n: int) -> None:
    """A batch's rows share each tile's indices and values four x rows at a time (11 rows: two
    fours and three singles); each row's sums are its own, so alone it gives the same bits, on
    every instruction-set level this CPU has."""
    module = Sparse24Linear.from_linear(_linear(64, n), None, int8=int8)
    x = torch.randn(11, n)
    levels = ("scalar", "avx2", "avx512")
    try:
        for level in levels[:levels.index(kernels.CAPS.cpu_isa) + 1]:
            kernels._C.set_isa(level)
            batched = kernels.sparse24_gemm(x, module.values, module.meta, module.scale, module.bias, n)
            for i in range(11):
                alone = kernels.sparse24_gemm(x[i:i + 1], module.values, module.meta, module.scale, module.bias, n)
                assert torch.equal(batched[i:i + 1], alone), (level, i)
    finally:
        kernels._C.set_isa(kernels.CAPS.isa)


LOWERED = """
import torch
from brisk import kernels
from brisk.quant.sparse24 import Sparse24Linear, dense_24
from brisk.model.layers import Linear
assert kernels.CAPS.isa == "{isa}", kernels.CAPS.isa
torch.manual_seed(0)
for int8 in (False, True):
    for n in (576, 100):
        lin = Linear(n, (24,), True)
        with torch.no_grad():
            lin.weight.normal_(); lin.bias.normal_()
        m = Sparse24Linear.from_linear(lin, None, int8=int8)
        x = torch.randn(8, n)
        want = x @ dense_24(m.values, m.meta, m.scale, n).T + m.bias
        got = kernels.sparse24_gemm(x, m.values, m.meta, m.scale, m.bias, n)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), float((got - want).abs().max())
print("ok")
"""


@needs_kernel
@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_lowered_instruction_sets_give_the_dense_result(isa: str) -> None:
    levels = ("scalar", "avx2", "avx512")
    if levels.index(isa) > levels.index(kernels.CAPS.cpu_isa):
        pytest.skip(f"this CPU has no {isa}")
    env = {**os.environ, "BRISK_CPU_ISA": isa}
    result = subprocess.run([sys.executable, "-c", LOWERED.format(isa=isa)], capture_output=True, text=True, env=env,
                            timeout=300, check=False)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_dense_weight_gives_the_cpu_result() -> None:
    module = Sparse24Linear.from_linear(_linear(40, 576), None)
    x = torch.randn(4, 576)
    want = x @ dense_24(module.values, module.meta, None, 576).T + module.bias
    got = module.to("cuda")(x.cuda()).cpu()
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                    reason="needs a CUDA device with sparse tensor cores (compute capability 8.0+)")
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
                    and not torch.backends.cusparselt.is_available(),
                    reason="torch's CUTLASS 2:4 kernels are built for 8.x; a 9.0+ GPU needs cuSPARSELt")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_cuda_16_bit_models_run_torchs_semi_structured_tensors(dtype: torch.dtype) -> None:
    """A 16-bit model's 2:4 weight becomes torch's semi-structured sparse tensor on the GPU (only the
    kept half read); its result is the dense 16-bit product's, decode-sized and prompt-sized."""
    from torch.sparse import SparseSemiStructuredTensor

    module = Sparse24Linear.from_linear(_linear(128, 576), None)
    module.dtype = dtype
    dense = dense_24(module.values, module.meta, None, 576).to(dtype)
    module = module.to("cuda")
    for rows in (1, 3, 64):
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).to(dtype)
        want = torch.nn.functional.linear(x.cuda(), dense.cuda(), module.bias.to(dtype))
        got = module(x.cuda())
        assert isinstance(module._dense, SparseSemiStructuredTensor) and got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
