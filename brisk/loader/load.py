"""Load a model reference into a ready model + tokenizer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from brisk.config import ModelConfig, QuantConfig
from brisk.loader.gguf_loader import (
    gguf_model_config,
    gguf_raw_weights,
    gguf_weights,
    open_gguf,
)
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
    quantization: QuantConfig | None = None  # how the weights are quantized (by the checkpoint or at load)


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


def model_config_of(ref: str) -> ModelConfig:
    """The architecture config of `ref` without reading its weights (checks before a slow start)."""
    source = resolve_model(ref)
    if source.kind == "gguf":
        return gguf_model_config(open_gguf(source.path))
    check_hf_dir(source.path)
    return hf_model_config(source.path)


def load_model(ref: str, dtype: str = "float32", device: str = "cpu", max_model_len: int | None = None,
               quant: QuantConfig | None = None,
               before_quant: Callable[[LlamaForCausalLM], None] | None = None) -> LoadedModel:
    """Resolve `ref`, build the architecture and stream the weights into it; quantize with `quant`.

    A checkpoint written by `brisk quantize` loads as saved (`quant` must then be None or equal,
    but for `activations`, a run-time choice that `quant` may change).
    `before_quant` reshapes the float model first (tensor-parallel sharding: each shard is quantized)."""
    from brisk.loader.quantized import load_quantized_state, quantization_of
    from brisk.quant import set_activations

    source = resolve_model(ref)
    tdtype = torch_dtype(dtype)
    saved = quantization_of(source.path) if source.kind == "hf" else None
    if saved is not None:
        if quant is not None and (quant.method != saved.method
                                  or (quant.method == "int4" and quant.group_size != saved.group_size)):
            raise ValueError(f"{ref} is already quantized ({saved.describe()}); drop the quantization option "
                             f"({quant.describe()}) or quantize the original model")
        check_hf_dir(source.path)
        cfg, tokenizer = hf_model_config(source.path), Tokenizer.from_hf_dir(source.path)
        _check_len(cfg, max_model_len)
        with torch.device(device):
            model = build_model(cfg, tdtype, max_positions=max_model_len or cfg.max_position_embeddings)
        load_quantized_state(model, source.path, saved)
        if quant is not None and quant.activations is not None:
            saved = dataclasses.replace(saved, activations=quant.activations)
        set_activations(model, saved.act_mode)
        if before_quant is not None:
            before_quant(model)
        return LoadedModel(model.eval(), tokenizer, cfg, source, saved)
    if quant is not None and quant.method == "gguf" and source.kind != "gguf":
        raise ValueError(f"quantization gguf keeps a GGUF file's own blocks, but {ref} is not a .gguf file; "
                         "choose int8 or int4 for other models")
    cfg, tokenizer, weights = read_checkpoint(source)
    _check_len(cfg, max_model_len)
    with torch.device(device):
        model = build_model(cfg, tdtype, max_positions=max_model_len or cfg.max_position_embeddings)
    with torch.no_grad():
        model.load_weights(weights)
    if before_quant is not None:
        before_quant(model)
    if quant is not None:
        _quantize(model, quant, source, cfg, tokenizer)
        set_activations(model, quant.act_mode)
    return LoadedModel(model.eval(), tokenizer, cfg, source, quant)


def _quantize(model: LlamaForCausalLM, quant: QuantConfig, source: ModelSource, cfg: ModelConfig,
              tokenizer: Tokenizer) -> None:
    from brisk.quant import apply
    from brisk.quant.gguf import apply_gguf, is_native

    if quant.method == "gguf":
        counts = apply_gguf(model, gguf_raw_weights(open_gguf(source.path), cfg, is_native))
        if counts["native"] == 0:
            raise ValueError(f"{source.path} holds no Q4_0, Q4_1 or Q8_0 linear weights to keep as they are; "
                             "load it without -q gguf (dequantized), or with int8 / int4")
        return
    calibration = None
    if quant.calibration is not None:
        path = Path(quant.calibration)
        if not path.is_file():
            raise ValueError(f"calibration text {path} is not a file")
        text = path.read_text(encoding="utf-8", errors="replace")
        calibration = tokenizer.encode(text, add_special_tokens=False)[:quant.calibration_tokens]
        if len(calibration) < 16:
            raise ValueError(f"calibration text {path} gives {len(calibration)} tokens; at least 16 are needed "
                             f"(a few hundred are better)")
    apply(model, quant, calibration)
