"""`brisk convert`: write any model reference as an HF-format safetensors directory."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from brisk.config import ModelConfig, QuantConfig
from brisk.errors import UserError
from brisk.loader.hf_loader import hf_config_dict
from brisk.loader.load import read_checkpoint, torch_dtype
from brisk.loader.resolve import resolve_model
from brisk.loader.tokenizer import Tokenizer


def convert(ref: str, out: Path, dtype: str = "float32") -> Path:
    """Write config.json, model.safetensors, tokenizer files and generation_config.json to `out`."""
    source = resolve_model(ref)
    tdtype = torch_dtype(dtype)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    if source.kind == "hf" and out.resolve() == source.path.resolve():
        raise UserError("--out must differ from the source directory")
    cfg, tokenizer, weights = read_checkpoint(source)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        tensors[name] = tensor.to(tdtype).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg, dtype), indent=2) + "\n")
    write_tokenizer_files(tokenizer, cfg, out)
    return out


def write_tokenizer_files(tokenizer: Tokenizer, cfg: ModelConfig, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json (BOS, every EOS id)."""
    tokenizer.save_hf(out, model_max_length=cfg.max_position_embeddings)
    generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": sorted(tokenizer.eos_token_ids)}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def quantize_to_dir(ref: str, quant: QuantConfig, out: Path, dtype: str = "float32") -> Path:
    """`brisk quantize`: load, quantize, write a directory that loads back without re-quantizing."""
    from brisk.loader.load import load_model
    from brisk.loader.quantized import quantization_of, save_quantized
    from brisk.quant import method

    if method(quant).from_file_blocks:
        raise UserError("a .gguf file already is its gguf checkpoint: load it with -q gguf instead")
    source = resolve_model(ref)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    if source.kind == "hf" and out.resolve() == source.path.resolve():
        raise UserError("--out must differ from the source directory")
    saved = quantization_of(source.path) if source.kind == "hf" else None
    if saved is not None:
        raise UserError(f"{ref} is already quantized ({saved.describe()}); quantize the original model")
    loaded = load_model(ref, dtype=dtype, quant=quant)
    assert loaded.quantization is not None
    save_quantized(loaded.model, loaded.quantization, out, dtype)  # as resolved for the file (load.keep_file_grid)
    write_tokenizer_files(loaded.tokenizer, loaded.config, out)
    return out
