"""Calibration without a user's text (loader/calibration.py): the model's own generations by
default, cached on disk with the calibrated model, so `-q int4` is GPTQ-rounded from its first load
and quick from its second."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from brisk import LLM
from brisk.config import QuantConfig
from brisk.loader import calibration
from brisk.loader.quantized import MARKER, quantization_of
from brisk.model.base import forward_sequence, sample_batch
from brisk.quant.grouped import GroupLinear
from tests.parallel.conftest import TINY, write_tiny

# int4 groups of 32 fit every Linear: hidden 64, MLP 128
WIDE = dataclasses.replace(TINY, hidden_size=64, intermediate_size=128)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BRISK_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("wide") / "model", cfg=WIDE)


def _entries(cache: Path, kind: str) -> list[Path]:
    return sorted((cache / kind).glob("*")) if (cache / kind).is_dir() else []


def test_calibrated_methods_default_to_the_models_own_text() -> None:
    for method in ("int4", "w8a8", "sparse24"):
        assert QuantConfig(method).calibration == "self" and QuantConfig(method).calibrated
    assert QuantConfig("int4").describe() == "int4 g64 gptq self a16"
    assert QuantConfig("w8a8").describe() == "w8a8 smoothquant self"
    assert QuantConfig("int4", calibration="t.txt").describe() == "int4 g64 gptq a16"
    rtn = QuantConfig("int4", calibration="none")
    assert not rtn.calibrated and rtn.describe() == "int4 g64 rtn a16"
    assert QuantConfig("int8").calibration is None and not QuantConfig("int8").calibrated


def test_a_checkpoint_written_when_uncalibrated_was_the_default_stays_rtn(tmp_path: Path) -> None:
    (tmp_path / MARKER).write_text(json.dumps({"method": "int4", "format": "brisk", "group_size": 64,
                                               "calibration": None, "calibration_tokens": 4096}))
    saved = quantization_of(tmp_path)
    assert saved is not None and saved.calibration == "none" and saved.describe().startswith("int4 g64 rtn")


def test_sample_batch_is_seeded_stops_and_takes_prompts_of_any_length(tiny_llama) -> None:
    model = tiny_llama(layers=2)
    prompts = [[3, 4, 5, 6, 7], [9], [10, 11]]

    def sample(seed: int, **kw: object) -> list[list[int]]:
        return sample_batch(model, prompts, [6, 9, 0], torch.Generator().manual_seed(seed), **kw)  # type: ignore[arg-type]

    first = sample(0)
    assert [len(o) for o in first] == [6, 9, 0]  # each its own budget: the cache holds the longest
    assert sample(0) == first and sample(1) != first
    stop = first[1][2]
    stopped = sample(0, stop_ids=frozenset({stop}))
    assert stopped[1] == first[1][:first[1].index(stop) + 1]  # ends at (and keeps) the stop id
    # greedy continuations are the argmax of a whole-sequence forward at every step
    greedy = sample(0, temperature=0.0)
    for prompt, out in zip(prompts[:2], greedy[:2]):
        seq = prompt + out
        logits = model.compute_logits(forward_sequence(model, seq[:-1]))
        assert logits[len(prompt) - 1:].argmax(dim=-1).tolist() == out


def test_top_p_keeps_only_the_nucleus() -> None:
    from brisk.model.base import _draw

    logits = torch.tensor([0.6, 0.3, 0.07, 0.03]).log().expand(400, 4)
    gen = torch.Generator().manual_seed(0)
    assert set(_draw(logits, gen, 1.0, 0.5)) == {0}  # the first token alone reaches 0.5
    assert set(_draw(logits, gen, 1.0, 0.8)) == {0, 1}
    assert set(_draw(logits, gen, 1.0, 1.0)) == {0, 1, 2, 3}
    assert set(_draw(logits, gen, 0.0, 1.0)) == {0}  # temperature 0: greedy


def test_int4_calibrates_on_its_own_text_once_then_loads_from_the_cache(wide_dir: Path, cache: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    options = {"group_size": 32, "calibration_tokens": 96}
    first = LLM(str(wide_dir), quantization="int4", quantization_config=options, max_model_len=128, num_kv_blocks=16)
    assert first.quantization is not None and first.quantization.describe() == "int4 g32 gptq self a16"
    assert len(_entries(cache, "calibration")) == 1 and len(_entries(cache, "quantized")) == 1
    # no chat template: raw prompts continued, 96 ids of them
    assert len(calibration.generate(first.model, first.tokenizer, 96)) == 96

    def no_calibration(*args: object) -> None:
        raise AssertionError("a cached calibrated model was calibrated again")

    monkeypatch.setattr("brisk.loader.load.quantize_model", no_calibration)
    again = LLM(str(wide_dir), quantization="int4", quantization_config=options, max_model_len=128, num_kv_blocks=16)
    a, b = first.model.state_dict(), again.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(isinstance(m, GroupLinear) for m in again.model.modules())
    # another option is another entry: calibrated anew
    monkeypatch.undo()
    monkeypatch.setenv("BRISK_CACHE_DIR", str(cache))
    LLM(str(wide_dir), quantization="int4", quantization_config={**options, "calibration_tokens": 64},
        max_model_len=128, num_kv_blocks=16)
    assert len(_entries(cache, "quantized")) == 2


def test_an_unusable_cache_entry_is_calibrated_again(wide_dir: Path, cache: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    options = {"calibration_tokens": 64}
    first = LLM(str(wide_dir), quantization="w8a8", quantization_config=options, max_model_len=128, num_kv_blocks=16)
    [entry] = _entries(cache, "quantized")
    entry.write_bytes(b"not a safetensors file")
    with caplog.at_level(logging.WARNING):
        again = LLM(str(wide_dir), quantization="w8a8", quantization_config=options, max_model_len=128,
                    num_kv_blocks=16)
    assert "unreadable cache entry" in caplog.text
    a, b = first.model.state_dict(), again.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # calibrated again, to the same weights
    assert entry.stat().st_size > 100  # and cached again


def test_calibration_none_quantizes_without_calibrating(wide_dir: Path, cache: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_generation(*args: object) -> None:
        raise AssertionError("calibration none generated text")

    monkeypatch.setattr(calibration, "self_generated", no_generation)
    llm = LLM(str(wide_dir), quantization="int4", quantization_config={"group_size": 32, "calibration": "none"},
              max_model_len=128, num_kv_blocks=16)
    assert llm.quantization is not None and "rtn" in llm.quantization.describe()
    assert not _entries(cache, "quantized")  # round-to-nearest takes seconds: nothing cached


def test_a_missing_calibration_file_is_a_clear_error(wide_dir: Path, cache: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"calibration text .*missing.txt is not a file .*\"self\".*\"none\""):
        LLM(str(wide_dir), quantization="int4", quantization_config={"group_size": 32,
                                                                     "calibration": str(tmp_path / "missing.txt")})


def test_self_generated_text_is_prompts_and_answers(gguf_path: Path, cache: Path) -> None:
    """On the real model: chat-rendered prompts and the model's answers, the same text every time."""
    from brisk.loader.load import load_model
    from brisk.loader.resolve import resolve_model

    loaded = load_model("smollm2-135m", dequantize=True, max_model_len=256)
    source = resolve_model("smollm2-135m")
    ids = calibration.self_generated(loaded.model, loaded.tokenizer, source, 120)
    assert len(ids) == 120
    text = loaded.tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>user" in text and calibration.PROMPTS[0] in text and "<|im_start|>assistant" in text
    assert calibration.generate(loaded.model, loaded.tokenizer, 120) == ids  # seeded: the cache holds what it makes
