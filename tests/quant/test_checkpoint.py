"""`brisk quantize` checkpoints: reload bit-identically without re-quantizing; mismatches are
clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from brisk import LLM, SamplingParams
from brisk.cli import main
from brisk.loader.convert import quantize_to_dir


@pytest.fixture(scope="module")
def q8_dir(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> Path:
    return quantize_to_dir("smollm2-135m", "int8", tmp_path_factory.mktemp("q8") / "model")


def test_reload_is_bit_identical_to_quantizing_at_load(q8_dir: Path) -> None:
    saved = LLM(str(q8_dir), num_kv_blocks=64, max_model_len=512)
    fresh = LLM("smollm2-135m", quantization="int8", num_kv_blocks=64, max_model_len=512)
    assert saved.quantization == "int8"
    a, b = dict(saved.model.state_dict()), dict(fresh.model.state_dict())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    assert (saved.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].token_ids
            == fresh.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].token_ids)
    # asking for the method the checkpoint has is fine and does not quantize twice
    again = LLM(str(q8_dir), quantization="int8", num_kv_blocks=64, max_model_len=512)
    assert torch.equal(again.model.layers[0].mlp.down_proj.qweight, saved.model.layers[0].mlp.down_proj.qweight)


def test_mismatches_are_clear_errors(q8_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="already quantized"):
        quantize_to_dir(str(q8_dir), "int8", tmp_path / "twice")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in q8_dir.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "quantization.json").unlink()
    (bad / "quantization.json").write_text(json.dumps({"method": "int3"}))
    with pytest.raises(ValueError, match="quantized with 'int3'"):
        LLM(str(bad))
    assert main(["quantize", "smollm2-135m", "--method", "int8", "--out", str(q8_dir / "config.json")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_cli_refuses_an_unknown_method_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "-q", "int4", "--prompt", "hi"]) == 2
    assert "unknown quantization method 'int4'; available: int8" in capsys.readouterr().err
