"""EngineConfig refuses what cannot run before any weight is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from brisk.config import EngineConfig


@pytest.mark.parametrize(("device", "says"), [("tpu", "not a device name"), ("cuda:x", "not a device name"),
                                              ("meta", "runs on cpu or cuda")])
def test_unknown_devices_are_refused(device: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        EngineConfig(model="smollm2-135m", device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch sees a GPU")
def test_cuda_without_a_gpu_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="use --device cpu"):
        EngineConfig(model="smollm2-135m", device="cuda")


def test_cuda_index_past_the_devices_is_refused() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA build with a GPU")
    with pytest.raises(ValueError, match="CUDA device"):
        EngineConfig(model="smollm2-135m", device=f"cuda:{torch.cuda.device_count()}")


@pytest.mark.parametrize(("kwargs", "says"), [({"dtype": "int8"}, "unsupported dtype"),
                                              ({"max_model_len": 0}, "max_model_len must be > 0")])
def test_other_bad_settings_are_refused(kwargs: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        EngineConfig(model="smollm2-135m", **kwargs)  # type: ignore[arg-type]


NON_UNIFORM = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16}


def test_non_uniform_layers_keep_whole_gqa_groups() -> None:
    from brisk.config import ModelConfig

    cfg = ModelConfig(**NON_UNIFORM, layer_heads=(2, 4), layer_kv_heads=(1, 2), layer_intermediate=(64, 128))
    assert [cfg.heads(i) for i in range(2)] == [2, 4] and cfg.intermediate(0) == 64 and not cfg.uniform
    assert cfg.layer_params(0) == 64 * 16 * (2 * 2 + 2 * 1) + 3 * 64 * 64
    with pytest.raises(ValueError, match="keeps 2 query heads per KV head"):
        ModelConfig(**NON_UNIFORM, layer_heads=(3, 4), layer_kv_heads=(1, 2))
    with pytest.raises(ValueError, match="must give 2 values"):
        ModelConfig(**NON_UNIFORM, layer_intermediate=(64,))
    with pytest.raises(ValueError, match="come together"):
        ModelConfig(**NON_UNIFORM, layer_heads=(2, 4))


def test_non_uniform_layers_round_trip_through_config_json(tmp_path: Path) -> None:
    from brisk.config import ModelConfig
    from brisk.loader.hf_loader import LAYERS_KEY, hf_config_dict, hf_model_config

    cfg = ModelConfig(**NON_UNIFORM, layer_heads=(2, 4), layer_kv_heads=(1, 2), layer_intermediate=(64, 128),
                      output_bias=True)
    raw = hf_config_dict(cfg)
    assert raw[LAYERS_KEY]["num_key_value_heads"] == [1, 2]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert hf_model_config(tmp_path) == cfg
    assert LAYERS_KEY not in hf_config_dict(ModelConfig(**NON_UNIFORM))
