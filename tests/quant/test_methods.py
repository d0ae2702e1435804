"""Every quantization method on the real default model: through the batched engine, behind the
server, and (gguf) the file's own blocks giving the float model's greedy text."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from brisk import LLM, SamplingParams
from brisk.bench.eval_ppl import score_window, weight_bytes
from brisk.config import QuantConfig
from brisk.model.layers import Linear
from brisk.quant.grouped import GroupLinear

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.mark.parametrize("method", ["int8", "int4", "gguf"])
def test_quantized_model_through_the_batched_engine(method: str, brisk_llm: LLM) -> None:
    # round-to-nearest int4: the calibrated default (minutes of GPTQ) has its own test (test_calibration.py)
    llm = LLM("smollm2-135m", quantization=method, num_kv_blocks=256, max_model_len=1024,
              quantization_config={"calibration": "none", "group_size": 64} if method == "int4" else None)
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    alone = [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert batched == alone  # the batched engine changes nothing for a quantized model either
    ref = brisk_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    if method == "gguf":  # the file's own blocks: the float model's text exactly
        assert batched == [o.outputs[0].token_ids for o in ref]
    else:  # once a rounding flips a near-tie greedy texts part ways: compare next-token choices on one text
        scores = [score_window(llm.model, o.prompt_token_ids + o.outputs[0].token_ids, brisk_llm.model) for o in ref]
        assert sum(s.top1_agree for s in scores) / sum(s.tokens for s in scores) >= 0.7
    assert not any(isinstance(m, Linear) for m in llm.model.modules())


def test_gguf_native_blocks_are_the_float_models_weights(brisk_llm: LLM) -> None:
    llm = LLM("smollm2-135m", quantization="gguf", num_kv_blocks=64, max_model_len=512)
    qkv = llm.model.layers[3].self_attn.qkv_proj
    assert isinstance(qkv, GroupLinear) and qkv.bits == 4 and qkv.group == 32  # Q4_1 as stored
    assert llm.model.lm_head.bits == 8  # token_embd is Q8_0 in this file
    assert torch.equal(qkv.dequantize(), brisk_llm.model.layers[3].self_attn.qkv_proj.weight)
    ids = torch.tensor([1, 500, 49151])
    assert torch.equal(llm.model.embed_tokens(ids), brisk_llm.model.embed_tokens(ids))
    assert weight_bytes(llm.model) < 0.2 * weight_bytes(brisk_llm.model)


def test_int4_keeps_a_q4_1_files_grid_exactly_and_calibrates_nothing(brisk_llm: LLM,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    llm = LLM("smollm2-135m", quantization="int4", num_kv_blocks=64, max_model_len=512)
    assert llm.quantization is not None and llm.quantization.describe() == "int4 g32 rtn a16"
    float_layers = dict(brisk_llm.model.named_modules())
    quantized = {name: m for name, m in llm.model.named_modules() if isinstance(m, GroupLinear) and m.bits == 4}
    assert len(quantized) == 4 * len(llm.model.layers)  # qkv, o, gate_up, down
    for name, module in quantized.items():  # every 4-bit weight is the file's Q4_1 weight as stored
        assert module.group == 32 and torch.equal(module.dequantize(), float_layers[name].weight), name
    ref = brisk_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in ref]
    # the load's check: silent here, and names what a block off the recoverable grid would cost
    from brisk.loader.load import check_kept_grid

    floats = {name: float_layers[name].weight for name in quantized}
    with caplog.at_level(logging.WARNING, logger="brisk.loader.load"):
        check_kept_grid(llm.model, floats)
        assert "rounded" not in caplog.text
        first = next(iter(quantized))
        check_kept_grid(llm.model, {**floats, first: floats[first] * 1.001})
    assert f"int4 rounded 1 of the file's Q4 Linears again (first: {first})" in caplog.text


def test_int4_rounds_again_only_when_asked_or_when_the_file_is_not_q4(gguf_path: Path, tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    from brisk.loader.gguf_loader import open_gguf
    from brisk.loader.gguf_write import write_synthetic
    from brisk.loader.load import keep_file_grid

    q4 = open_gguf(gguf_path)
    assert keep_file_grid(QuantConfig("int4"), q4) == QuantConfig("int4", group_size=32, calibration="none")
    assert keep_file_grid(QuantConfig("int4", calibration="none"), q4) == QuantConfig("int4", group_size=32,
                                                                                      calibration="none")
    for asked in (QuantConfig("int4", group_size=64), QuantConfig("int4", group_size=64, calibration="none"),
                  QuantConfig("int4", calibration="text.txt"), QuantConfig("w8a8")):
        with caplog.at_level(logging.WARNING, logger="brisk.loader.load"):
            caplog.clear()
            assert keep_file_grid(asked, q4) == asked
        # rounding the file's blocks again is the user's explicit choice, and said so
        assert ("Q4_1 weights a second time" in caplog.text) == (asked.method == "int4")
    write_synthetic(gguf_path, tmp_path / "f32.gguf", hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1,
                    head_dim=32)
    caplog.clear()
    assert keep_file_grid(QuantConfig("int4"), open_gguf(tmp_path / "f32.gguf")).group == 64
    assert "second time" not in caplog.text  # float weights: rounded once


def test_gguf_needs_a_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="keeps a GGUF file's own blocks"):
        LLM(str(tmp_path), quantization="gguf")


@pytest.mark.parametrize("method", ["int4", "gguf"])
def test_quantized_model_behind_the_server(method: str) -> None:
    from fastapi.testclient import TestClient

    from brisk.server import build_app

    llm = LLM("smollm2-135m", quantization=method, num_kv_blocks=128, max_model_len=512,
              quantization_config={"calibration": "none", "group_size": 64} if method == "int4" else None)
    expected = llm.generate("Water boils at", SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    app = build_app(llm, api_key="")
    try:
        with TestClient(app) as client:
            r = client.post("/v1/completions", json={"prompt": "Water boils at", "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
            assert r.json()["choices"][0]["text"] == expected[0].outputs[0].text
    finally:
        app.state.brisk.engine.shutdown()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["int4", "w8a8", "ternary"])
def test_quantized_linear_on_cuda_equals_cpu(method: str) -> None:
    from brisk.quant import METHODS

    torch.manual_seed(0)
    lin = Linear(128, (64,), bias=True)
    lin.weight.data.normal_(0, 0.1)
    module = METHODS[method].make(lin, QuantConfig(method), None)  # type: ignore[misc]
    x = torch.randn(40, 128)
    cpu = module(x)
    torch.testing.assert_close(module.to("cuda")(x.cuda()).cpu(), cpu, atol=1e-4, rtol=1e-4)


def test_quantized_buffers_keep_their_dtypes_when_the_model_changes_dtype(tiny_llama) -> None:
    from brisk.quant import apply

    model = tiny_llama(tied=True, layers=1)
    apply(model, QuantConfig("int4", group_size=32))  # the tiny MLP is 96 wide
    model.to(torch.bfloat16)
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.scale.dtype == torch.float16 and qkv.qweight.dtype == torch.uint8 and qkv.dtype == torch.bfloat16
    assert model.embed_tokens(torch.tensor([3])).dtype == torch.bfloat16
    assert qkv(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_calibration_text_too_short_is_a_clear_error(tmp_path: Path) -> None:
    text = tmp_path / "short.txt"
    text.write_text("Hello there.")
    with pytest.raises(ValueError, match="at least 16 are needed"):
        LLM("smollm2-135m", quantization="int4", quantization_config={"calibration": str(text)})
    with pytest.raises(ValueError, match="is not a file"):
        LLM("smollm2-135m", quantization="w8a8", quantization_config={"calibration": str(tmp_path / "none.txt")})


def test_quantizing_on_the_default_device_runs_without_a_device_mode() -> None:
    """A device context sends every torch call through a Python mode (~20 us each): GPTQ's and
    SparseGPT's column sweeps make ~1.6 million calls on the default model. Quantizing where new
    tensors go anyway (the CPU) enters none; another device (here `meta`) still gets its tensors."""
    import torch.overrides

    from brisk.quant import _made_on

    with _made_on(torch.device("cpu")):
        assert not torch.overrides._get_current_function_mode_stack()
        assert torch.zeros(1).device.type == "cpu"
    with _made_on(torch.device("meta")):
        assert torch.zeros(1).device.type == "meta"
