"""brisk._C streaming GEMV against F.linear (float32 accumulation, summation order aside)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from brisk import kernels
from brisk.model.layers import linear

needs_ext = pytest.mark.skipif(not kernels.HAVE_CPU_GEMV, reason="brisk._C not built (pip install --no-build-isolation .)")


@needs_ext
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (7, 5), (9, 33), (1, 1), (130, 100)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_float32_matches_linear(shape: tuple[int, int], with_bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g)
    x = torch.randn(1, shape[1], generator=g)
    b = torch.randn(shape[0], generator=g) if with_bias else None
    got = kernels.gemv(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    assert got.shape == (1, shape[0]) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-4 * shape[1] ** 0.5, rtol=1e-5)


@needs_ext
def test_gemv_bfloat16_accumulates_in_float32() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 576, generator=g).bfloat16()
    x = torch.randn(1, 576, generator=g).bfloat16()
    got = kernels.gemv(x, w)
    ref = F.linear(x.double(), w.double()).bfloat16()  # exact products, one rounding at the end
    assert got.dtype == torch.bfloat16
    assert (got.float() - ref.float()).abs().max() <= ref.float().abs().max() * 2 ** -7


@needs_ext
def test_gemv_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        kernels.gemv(torch.randn(1, 3), torch.randn(4, 5))
    with pytest.raises(ValueError, match="does not fit"):
        kernels.gemv(torch.randn(1, 5), torch.randn(4, 5).bfloat16())


def test_linear_falls_back_for_batches_and_non_contiguous_weights() -> None:
    w = torch.randn(16, 8)
    x = torch.randn(3, 8)
    torch.testing.assert_close(linear(x, w), F.linear(x, w))
    wt = torch.randn(8, 16).t()  # not contiguous: BLAS path
    torch.testing.assert_close(linear(x[:1], wt), F.linear(x[:1], wt))
    assert not kernels.gemv_supported(wt)


@needs_ext
@pytest.mark.skipif(kernels.SMALL_GEMM_MAX_ROWS < 2, reason="small_gemm needs AVX-512")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_gemm_rows_are_bit_identical_to_gemv(dtype: torch.dtype) -> None:
    """Batch invariance: a row's result does not depend on how many rows share the call."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(203, 100, generator=g).to(dtype)  # 100 % 16 != 0 and 203 % 4 != 0: both tails
    x = torch.randn(kernels.SMALL_GEMM_MAX_ROWS, 100, generator=g).to(dtype)
    b = torch.randn(203, generator=g).to(dtype)
    for m in (2, 3, 7, 8, 13, kernels.SMALL_GEMM_MAX_ROWS):
        y = kernels.small_gemm(x[:m], w, b)
        for row in range(m):
            assert torch.equal(y[row:row + 1], kernels.gemv(x[row:row + 1], w, b))
    torch.testing.assert_close(kernels.small_gemm(x, w).float(), F.linear(x.float(), w.float()),
                               atol=1e-4 if dtype == torch.float32 else 0.5, rtol=1e-3 if dtype == torch.float32 else 2e-2)


needs_packing = pytest.mark.skipif(not kernels.HAVE_ONEDNN_PACKING, reason="this torch has no oneDNN weight packing")


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_packed_linear_matches_linear_and_rows_do_not_depend_on_batch(dtype: torch.dtype) -> None:
    if dtype not in kernels.PACK_DTYPES:  # bfloat16 on an AVX2-only CPU: oneDNN refuses the reorder
        assert not kernels.pack_supported(torch.zeros(8, 8, dtype=dtype))
        with pytest.raises(RuntimeError):
            kernels.pack_weight(torch.zeros(8, 8, dtype=dtype))
        pytest.skip(f"oneDNN packs no {dtype} weight on this CPU (brisk leaves such weights unpacked)")
    torch.manual_seed(0)
    for out_f, in_f in [(960, 576), (576, 1536), (100, 40)]:
        w = (torch.randn(out_f, in_f) * 0.05).to(dtype)
        b = torch.randn(out_f).to(dtype)
        x = torch.randn(70, in_f).to(dtype)
        packed = kernels.pack_weight(w)
        ref = F.linear(x.float(), w.float(), b.float())
        got = kernels.packed_linear(x, packed, b)
        tol = 1e-4 if dtype == torch.float32 else 0.05
        assert (got.float() - ref).abs().max() < tol * max(1.0, float(ref.abs().max()))
        # the engine's exactness tests rely on this: a row's result is the same in any batch of >= 2
        for m in (2, 3, 17, 32, 33, 64):
            assert torch.equal(kernels.packed_linear(x[:m], packed, b), got[:m])


@needs_packing
def test_packed_copies_follow_the_model() -> None:
    from brisk.config import ModelConfig
    from brisk.model.llama import LlamaForCausalLM

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    h = torch.randn(5, 32)
    ref = model.compute_logits(h)
    assert model.pack_weights() > 0 and model.layers[0].mlp.down_proj.packed is not None
    torch.testing.assert_close(model.compute_logits(h), ref, atol=1e-5, rtol=1e-5)  # tied head, packed
    model.to(torch.bfloat16)  # a moved/cast model must not keep float32 copies
    assert model.layers[0].mlp.down_proj.packed is None and model._tied_head_packed is None


needs_glue = pytest.mark.skipif(not kernels.rotary_supported(torch.zeros(1, 2), torch.zeros(1)),
                                reason="brisk._C without the rotary / kv_store kernels")


@needs_glue
@pytest.mark.parametrize("n", [1, 5, 40])
def test_rotary_kernel_gives_apply_rotarys_floats(n: int) -> None:
    """Bit for bit: every product and the sum rounded as torch rounds them (no fused multiply-add),
    on q and k heads at the front of a fused qkv row (a strided view)."""
    from brisk.config import RopeScaling
    from brisk.model.rotary import apply_rotary, rope_tables

    heads, kv, hd = 9, 3, 64
    g = torch.Generator().manual_seed(n)
    qkv = torch.randn(n, (heads + 2 * kv) * hd, generator=g) * 3
    cos_t, sin_t = rope_tables(hd, 100000.0, RopeScaling(), 8192, 4096)
    pos = torch.randint(0, 4096, (n,), generator=g)
    cos, sin = cos_t[pos].unsqueeze(1), sin_t[pos].unsqueeze(1)
    ref = apply_rotary(qkv[:, : (heads + kv) * hd].view(n, heads + kv, hd), cos, sin)
    assert torch.equal(kernels.rotary(qkv, heads + kv, cos, sin), ref)


@needs_glue
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_store_writes_what_index_put_writes(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    blocks, n_kv, hd, bs, n = 6, 3, 64, 16, 7
    k_cache = torch.randn(blocks, n_kv, hd, bs, generator=g).to(dtype)
    v_cache = torch.randn(blocks, n_kv, bs, hd, generator=g).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    qk = torch.randn(n, 12, hd, generator=g).to(dtype)
    k = qk[:, 9:]  # a view into the rotated heads, as the model passes it
    v = torch.randn(n, n_kv * hd, generator=g).to(dtype).view(n, n_kv, hd)
    slot_blocks = torch.tensor([0, 0, 5, 2, 2, 2, 4])
    slot_offsets = torch.tensor([0, 15, 3, 7, 8, 9, 0])
    k_ref[slot_blocks, :, :, slot_offsets] = k
    v_ref[slot_blocks, :, slot_offsets] = v
    kernels.kv_store(k_cache, v_cache, k, v, slot_blocks, slot_offsets)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.kv_store(k_cache, v_cache, k[:1], v[:1], torch.tensor([6]), torch.tensor([0]))


@pytest.mark.parametrize("shape", [(1, 576), (3, 33), (70, 100), (1, 1), (2, 1536)])
def test_rms_norm_kernel_matches_torch(shape: tuple[int, int]) -> None:
    """Every ISA's path (the suite runs this file again under BRISK_CPU_ISA=avx2 and scalar): each
    reduces the sum of squares in its own lane order, so a few float32 ulp from torch's, no more."""
    if not kernels.rms_norm_supported(torch.zeros(1), torch.zeros(1)):
        pytest.skip("the rms_norm kernel is not built")
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    x, w = torch.randn(shape, generator=g) * 3, torch.randn(shape[1], generator=g)
    want = F.rms_norm(x, (shape[1],), w, 1e-5)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), want, rtol=4e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 2 * 1536), (5, 2 * 17), (40, 2 * 64)])
def test_silu_mul_kernel_matches_torch(shape: tuple[int, int]) -> None:
    gate_up = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0])) * 8  # exp's range, both signs
    if not kernels.silu_mul_supported(gate_up):
        pytest.skip("the silu_mul kernel is not built")
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up, rtol=4e-6, atol=1e-6)
