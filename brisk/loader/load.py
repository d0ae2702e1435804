"""Load a model reference into a ready model + tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from brisk.config import ModelConfig
from brisk.loader.gguf_loader import gguf_model_config, gguf_weights, open_gguf
from brisk.loader.hf_loader import check_hf_dir, hf_model_config, hf_weights
from brisk.loader.resolve import ModelSource, resolve_model
from brisk.loader.tokenizer import Tokenizer
from brisk.model.llama import LlamaForCausalLM
from brisk.model.registry import build_model

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    source: ModelSource
    quantization: str | None = None  # set when the checkpoint itself is quantized


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of: {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def read_checkpoint(source: ModelSource) -> tuple[ModelConfig, Tokenizer, Iterator[tuple[str, torch.Tensor]]]:
    """Config, tokenizer and a lazy stream of HF-named float tensors, whatever the format."""
    if source.kind == "gguf":
        file = open_gguf(source.path)
        cfg = gguf_model_config(file)
        return cfg, Tokenizer.from_gguf_metadata(file.metadata), gguf_weights(file, cfg)
    check_hf_dir(source.path)
    cfg = hf_model_config(source.path)
    return cfg, Tokenizer.from_hf_dir(source.path), hf_weights(source.path)


def _check_len(cfg: ModelConfig, max_model_len: int | None) -> None:
    if max_model_len is not None and max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context window "
                         f"({cfg.max_position_embeddings} tokens)")


def load_model(ref: str, dtype: str = "float32", device: str = "cpu",
               max_model_len: int | None = None) -> LoadedModel:
    """Resolve `ref`, build the architecture and stream the weights into it."""
    from brisk.loader.quantized import load_quantized_state, quantization_of

    source = resolve_model(ref)
    tdtype = torch_dtype(dtype)
    method = quantization_of(source.path) if source.kind == "hf" else None
    if method is not None:
        check_hf_dir(source.path)
        cfg, tokenizer = hf_model_config(source.path), Tokenizer.from_hf_dir(source.path)
        _check_len(cfg, max_model_len)
        with torch.device(device):
            model = build_model(cfg, tdtype, max_positions=max_model_len or cfg.max_position_embeddings)
        load_quantized_state(model, source.path, method)
        return LoadedModel(model.eval(), tokenizer, cfg, source, method)
    cfg, tokenizer, weights = read_checkpoint(source)
    _check_len(cfg, max_model_len)
    with torch.device(device):
        model = build_model(cfg, tdtype, max_positions=max_model_len or cfg.max_position_embeddings)
    with torch.no_grad():
        model.load_weights(weights)
    return LoadedModel(model.eval(), tokenizer, cfg, source)
