"""`brisk eval ppl`: the perplexity equals HF transformers' on the same windows; bfloat16 reports
a small, non-zero drift from float32."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from brisk.bench.eval_ppl import eval_ppl
from brisk.cli import main

TEXT = ("The tower is 324 metres tall, about the same height as an 81-storey building, and the tallest "
        "structure in Paris. Its base is square, measuring 125 metres on each side. During its construction, "
        "the Eiffel Tower surpassed the Washington Monument to become the tallest man-made structure in the "
        "world, a title it held for 41 years until the Chrysler Building in New York City was finished in 1930. ") * 4


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ppl") / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def test_perplexity_equals_hf_on_the_same_windows(text_file: Path, hf_model, hf_tokenizer) -> None:
    res = eval_ppl("smollm2-135m", "float32", text_file, window=96, max_tokens=250, quant={"dequantize": True})
    ids = hf_tokenizer(TEXT, add_special_tokens=False)["input_ids"][:250]
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(ids) - 1, 96):
            chunk = torch.tensor([ids[i:i + 96]])
            if chunk.shape[1] < 2:
                break
            out = hf_model(chunk, labels=chunk)  # mean NLL over positions 1..
            nll += float(out.loss) * (chunk.shape[1] - 1)
            count += chunk.shape[1] - 1
    assert res["tokens_scored"] == count == 250 - 3  # three windows, each loses its first token
    assert res["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-4)
    assert res["kl_vs_float32"] == 0.0 and res["top1_agreement_vs_float32"] == 1.0
    assert res["decode_tokens_per_s"] > 0 and res["weight_mib"] > 100


def test_the_file_as_stored_is_measured_against_its_float_twin(text_file: Path) -> None:
    """By default a .gguf runs from its blocks; the float32 reference is the same file dequantized."""
    res = eval_ppl("smollm2-135m", "float32", text_file, window=96, max_tokens=250)
    ref = eval_ppl("smollm2-135m", "float32", text_file, window=96, max_tokens=250, quant={"dequantize": True})
    assert res["quantization"] == "gguf a16" and ref["quantization"] is None
    assert res["perplexity"] == pytest.approx(ref["perplexity"], rel=3e-3)
    # Q4_1 in int16-activation kernels and the Q8_0 head in float ones: below 1e-6, KL rounds to 0.0
    assert 0.0 <= res["kl_vs_float32"] < 1e-3 and res["top1_agreement_vs_float32"] > 0.98
    assert res["weight_mib"] < 0.2 * ref["weight_mib"]


def test_bfloat16_drift_is_measured(text_file: Path) -> None:
    res = eval_ppl("smollm2-135m", "bfloat16", text_file, window=128, max_tokens=200)
    assert 0.0 < res["kl_vs_float32"] < 0.1 and 0.8 < res["top1_agreement_vs_float32"] < 1.0


def test_pruned_at_load_is_measured_against_the_dense_model(text_file: Path) -> None:
    readme = str(Path(__file__).resolve().parents[2] / "README.md")
    pruning = {"method": "layers", "ratio": 0.1, "calibration": readme, "calibration_tokens": 512}
    res = eval_ppl("smollm2-135m", "float32", text_file, window=96, max_tokens=250, quant={"pruning": pruning})
    dense = eval_ppl("smollm2-135m", "float32", text_file, window=96, max_tokens=250, quant={"dequantize": True})
    assert res["pruning"]["method"] == "layers" and res["pruning"]["seconds"] > 0
    assert res["params"] < res["pruning"]["params_dense"] == dense["params"]
    assert res["weight_mib"] < dense["weight_mib"] and res["perplexity"] > dense["perplexity"]
    assert res["kl_vs_float32"] > 0 and res["top1_agreement_vs_float32"] < 1.0


def test_probe_pruning_is_scored_per_window_and_from_a_prompt(text_file: Path) -> None:
    """Probe Pruning decides on each window (the paper's protocol), or with score_from on the
    window's unscored head only (generation's view: nothing scored is seen before it is predicted);
    the dense model it runs on is the reference."""
    readme = str(Path(__file__).resolve().parents[2] / "README.md")
    pruning = {"method": "probe", "ratio": 0.3, "calibration": readme, "calibration_tokens": 512}
    window = eval_ppl("smollm2-135m", "float32", text_file, window=96, max_tokens=250, quant={"pruning": pruning})
    prompt = eval_ppl("smollm2-135m", "float32", text_file, window=96, max_tokens=250, quant={"pruning": pruning},
                      score_from=48)
    # windows of 96, 96 and 58 tokens: all but the first of each, or from position 48
    assert window["tokens_scored"] == 249 - 2 and prompt["tokens_scored"] == 2 * 48 + 58 - 48
    for res in (window, prompt):
        assert res["pruning"]["method"] == "probe" and res["pruning"]["decision_seconds"] > 0
        assert res["kl_vs_float32"] > 0 and res["perplexity"] > 0 and res["top1_agreement_vs_float32"] < 1
        assert res["params"] < res["pruning"]["params_dense"]
        assert res["weight_mib"] < res["pruning"]["dense_weight_mib"]
    assert "first 48 tokens" in prompt["pruning"]["decision"] and "per window" in window["pruning"]["decision"]
    with pytest.raises(ValueError, match="--score-from must be a position inside the window"):
        eval_ppl("smollm2-135m", "float32", text_file, window=96, max_tokens=250, score_from=96)


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "ppl", "--text", str(tmp_path / "missing.txt")]) == 2
    assert "is not a file" in capsys.readouterr().err
    assert main(["eval", "ppl", "--text", str(tmp_path), "--window", "1"]) == 2
