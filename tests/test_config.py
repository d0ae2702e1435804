"""EngineConfig refuses what cannot run before any weight is read."""

from __future__ import annotations

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
