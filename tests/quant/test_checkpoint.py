"""`brisk quantize` checkpoints: reload bit-identically without re-quantizing; mismatches are
clear errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from brisk import LLM, SamplingParams
from brisk.bench.eval_ppl import eval_ppl
from brisk.cli import main
from brisk.config import QuantConfig
from brisk.loader.convert import quantize_to_dir

INT8 = QuantConfig("int8")
CALIBRATION = """The river flows past the old mill, where the miller grinds wheat into flour every autumn.
In 1887 the town council voted to build a stone bridge; it opened three years later, in 1890.
def mean(xs): return sum(xs) / len(xs)  # a line of Python among the prose
Photosynthesis turns light, water and carbon dioxide into sugar and oxygen inside the chloroplasts.
"Where are you going?" she asked. "To the market, before the rain starts," he replied, smiling.
The committee's report lists 42 recommendations, of which 17 concern schools and 9 concern roads.
Mount Everest, at 8,849 metres, is the highest mountain above sea level on Earth.
"""


@pytest.fixture(scope="module")
def q8_dir(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> Path:
    return quantize_to_dir("smollm2-135m", INT8, tmp_path_factory.mktemp("q8") / "model")


# GPTQ calibrates for ~90 s here: a slow check (pytest -m slow), the int8 case runs always
@pytest.mark.parametrize("method", ["int8", pytest.param("int4-gptq", marks=pytest.mark.slow)])
def test_reload_is_bit_identical_to_quantizing_at_load(method: str, q8_dir: Path, tmp_path: Path) -> None:
    if method == "int8":
        folder, kwargs = q8_dir, {"quantization": "int8"}
    else:
        calib = tmp_path / "calib.txt"
        calib.write_text(CALIBRATION)
        options = {"group_size": 64, "calibration": str(calib), "calibration_tokens": 128}
        folder = quantize_to_dir("smollm2-135m", QuantConfig.parse("int4", options), tmp_path / "q4")
        kwargs = {"quantization": "int4", "quantization_config": options}
    saved = LLM(str(folder), num_kv_blocks=64, max_model_len=512)
    fresh = LLM("smollm2-135m", num_kv_blocks=64, max_model_len=512, **kwargs)  # type: ignore[arg-type]
    # the same method and options; the checkpoint names its activations, the fresh load defaults them
    assert saved.quantization is not None and fresh.quantization is not None
    assert dataclasses.replace(saved.quantization, activations=saved.quantization.act_mode) == \
        dataclasses.replace(fresh.quantization, activations=fresh.quantization.act_mode)
    a, b = dict(saved.model.state_dict()), dict(fresh.model.state_dict())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    assert (saved.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].token_ids
            == fresh.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].token_ids)
    # asking for the method the checkpoint has is fine and does not quantize twice
    if method != "int8":
        return
    again = LLM(str(q8_dir), quantization="int8", num_kv_blocks=64, max_model_len=512)
    assert torch.equal(again.model.layers[0].mlp.down_proj.qweight_rows(), saved.model.layers[0].mlp.down_proj.qweight_rows())


def test_mismatches_are_clear_errors(q8_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="already quantized"):
        quantize_to_dir(str(q8_dir), INT8, tmp_path / "twice")
    with pytest.raises(ValueError, match="already quantized"):
        LLM(str(q8_dir), quantization="int4")
    with pytest.raises(ValueError, match="already is its gguf checkpoint"):
        quantize_to_dir("smollm2-135m", QuantConfig("gguf"), tmp_path / "g")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in q8_dir.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "quantization.json").unlink()
    (bad / "quantization.json").write_text(json.dumps({"method": "int3"}))
    with pytest.raises(ValueError, match="quantized with 'int3'"):
        LLM(str(bad))
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in q8_dir.iterdir():
        if f.name != "model.safetensors":
            (broken / f.name).symlink_to(f)
    state = load_file(str(q8_dir / "model.safetensors"))
    state["layers.0.mlp.down_proj.scale"] = torch.ones(3)
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="does not match a int8 model of its config"):
        LLM(str(broken))
    text = tmp_path / "t.txt"
    text.write_text("A few words to score. " * 10)
    with pytest.raises(ValueError, match="is a quantized checkpoint"):
        eval_ppl(str(q8_dir), "float32", text, 64, None)
    assert main(["quantize", "smollm2-135m", "--method", "int8", "--out", str(q8_dir / "config.json")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_cli_refuses_an_unknown_method_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "-q", "int3", "--prompt", "hi"]) == 2
    assert "unknown quantization method 'int3'; available: int8, int4, w8a8, ternary, gguf" in capsys.readouterr().err
    assert main(["generate", "-q", "int4", "--quant-config", '{"group": 64}', "--prompt", "hi"]) == 2
    assert "unknown quantization option(s) group" in capsys.readouterr().err
