"""Hugging Face-format model directories: config.json + *.safetensors (+ tokenizer files)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from brisk.config import ModelConfig, RopeScaling
from brisk.model.registry import check_architecture

REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


def check_hf_dir(path: Path) -> None:
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if not list(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ValueError(
            f"{path} is not a complete Hugging Face model directory: missing {', '.join(missing)} "
            "(brisk needs config.json, *.safetensors, tokenizer.json and tokenizer_config.json; "
            "`brisk convert` writes such a directory)"
        )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None


def hf_model_config(path: Path) -> ModelConfig:
    raw = _read_json(path / "config.json")
    arch = raw.get("model_type", "")
    check_architecture(arch)
    heads = raw["num_attention_heads"]
    rope = raw.get("rope_scaling") or raw.get("rope_parameters")
    theta = raw.get("rope_theta") or (rope or {}).get("rope_theta", 10000.0)
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=RopeScaling.from_hf(rope),
            # Qwen2 always has QKV bias; Llama says so with attention_bias.
            attention_bias=bool(raw.get("attention_bias", arch == "qwen2")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw["eos_token_id"][0] if isinstance(raw.get("eos_token_id"), list) else raw.get("eos_token_id"),
        )
    except KeyError as exc:
        raise ValueError(f"{path / 'config.json'} lacks the field {exc.args[0]!r}") from None


def hf_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every *.safetensors file, memory-mapped, one tensor at a time."""
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error type on corrupt headers
            raise ValueError(f"cannot read {file}: {exc}; the file may be truncated or corrupt") from None


def hf_config_dict(cfg: ModelConfig, torch_dtype: str = "float32") -> dict[str, Any]:
    """The config.json HF transformers (and brisk) read back for `cfg`."""
    arch_class = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    out: dict[str, Any] = {
        "architectures": [arch_class[cfg.architecture]],
        "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling.to_hf(),
        "attention_bias": cfg.attention_bias,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": torch_dtype,
    }
    if cfg.bos_token_id is not None:
        out["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_id is not None:
        out["eos_token_id"] = cfg.eos_token_id
    return out
