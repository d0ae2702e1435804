"""Hugging Face-format model directories: config.json + *.safetensors (+ tokenizer files)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from brisk.config import ModelConfig, RopeScaling
from brisk.errors import UserError
from brisk.model.registry import canonical_architecture

REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


def check_hf_dir(path: Path) -> None:
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if not list(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise UserError(
            f"{path} is not a complete Hugging Face model directory: missing {', '.join(missing)} "
            "(brisk needs config.json, *.safetensors, tokenizer.json and tokenizer_config.json; "
            "`brisk convert` writes such a directory)"
        )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None


def hf_model_config(path: Path) -> ModelConfig:
    raw = _read_json(path / "config.json")
    arch = canonical_architecture(raw.get("model_type", ""))
    heads = raw.get("num_attention_heads")
    try:
        rope = _rope_parameters(raw, arch)
        theta = raw.get("rope_theta") or (rope or {}).get("rope_theta", 10000.0)
        return ModelConfig(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rotary_dim=_rotary_dim(raw, rope),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=RopeScaling.from_hf(rope),
            # Qwen2 always has QKV bias; Llama says so with attention_bias.
            attention_bias=bool(raw.get("attention_bias", arch == "qwen2")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch == "gemma3")),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw["eos_token_id"][0] if isinstance(raw.get("eos_token_id"), list) else raw.get("eos_token_id"),
            **_family_fields(raw, arch),
            **_layer_widths(raw),
        )
    except KeyError as exc:
        raise UserError(f"{path / 'config.json'} lacks the field {exc.args[0]!r}") from None


def _rope_parameters(raw: dict[str, Any], arch: str) -> dict[str, Any] | None:
    """The (global layers') rope scaling dict: `rope_scaling`, or `rope_parameters` (newer
    configs; Gemma 3 keys it by layer type)."""
    rope = raw.get("rope_scaling") or raw.get("rope_parameters")
    if arch == "gemma3" and isinstance(rope, dict) and "full_attention" in rope:
        return rope["full_attention"]
    kind = (rope or {}).get("rope_type", (rope or {}).get("type"))
    if kind in ("longrope", "su"):
        # Phi-3 keeps the pretrained window beside the config; the default factor is their ratio (HF's rule)
        orig = rope.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
        if not orig:
            raise UserError("longrope scaling needs original_max_position_embeddings in config.json")
        rope = {**rope, "original_max_position_embeddings": orig,
                "factor": rope.get("factor") or raw.get("max_position_embeddings", orig) / orig}
    return rope


def _rotary_dim(raw: dict[str, Any], rope: dict[str, Any] | None) -> int:
    """Dims of a head that rotate: head_dim x partial_rotary_factor (Phi-4-mini: 0.75), HF's int()."""
    partial = raw.get("partial_rotary_factor") or (rope or {}).get("partial_rotary_factor") or 1.0
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    return int(head_dim * partial)


_HF_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _family_fields(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """Config fields beyond Llama's: activation, per-layer attention kinds, QK norm, Gemma's scales."""
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if act not in _HF_ACTS:
        raise UserError(f"activation {act!r} is not supported; supported: {', '.join(sorted(_HF_ACTS))}")
    out: dict[str, Any] = {"hidden_act": _HF_ACTS[act], "qk_norm": arch in ("qwen3", "gemma3")}
    layers, window = raw["num_hidden_layers"], raw.get("sliding_window") or 0
    types = raw.get("layer_types")
    if arch == "gemma3":
        pattern = raw.get("sliding_window_pattern", 6)
        types = types or ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        local = (raw.get("rope_parameters") or {}).get("sliding_attention", {}).get("rope_theta")
        out.update(query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
                   rope_local_theta=float(raw.get("rope_local_base_freq") or local or 10000.0),
                   final_logit_softcapping=float(raw.get("final_logit_softcapping") or 0.0))
        if raw.get("attn_logit_softcapping"):
            raise UserError("attention logit soft-capping (Gemma 2) is not supported")
    elif arch in ("mistral", "phi3") and window and not types:
        types = ["sliding_attention"] * layers  # Mistral, Phi-3: every layer slides when the config has a window
    elif arch in ("qwen2", "qwen3"):
        # Qwen configs carry a window they use only with use_sliding_window, from max_window_layers on
        first = raw.get("max_window_layers", layers)
        types = (types or ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]) \
            if raw.get("use_sliding_window", False) else None
    if window >= raw.get("max_position_embeddings", window + 1):
        types = None  # a window as long as the context (Phi-3.5's 262144) never slides
    if types and "sliding_attention" in types and window:
        out.update(layer_types=tuple("sliding" if t == "sliding_attention" else "full" for t in types),
                   sliding_window=int(window))
    return out


# A structurally pruned model (compress/prune.py) keeps its per-layer widths under this key of
# config.json; HF transformers has no such field, so only brisk loads such a directory.
LAYERS_KEY = "brisk_layers"


def _layer_widths(raw: dict[str, Any]) -> dict[str, Any]:
    """Per-layer head counts, MLP widths and output biases of a pruned model; {} when uniform."""
    block = raw.get(LAYERS_KEY)
    if block is None:
        return {}
    if not isinstance(block, dict):
        raise UserError(f"config.json: {LAYERS_KEY} must be an object, got {block!r}")  # noqa: TRY004
    return {"layer_heads": tuple(block.get("num_attention_heads", ())),
            "layer_kv_heads": tuple(block.get("num_key_value_heads", ())),
            "layer_intermediate": tuple(block.get("intermediate_size", ())),
            "output_bias": bool(block.get("output_bias", False))}


def hf_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every *.safetensors file, memory-mapped, one tensor at a time."""
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error type on corrupt headers
            raise UserError(f"cannot read {file}: {exc}; the file may be truncated or corrupt") from None


def hf_config_dict(cfg: ModelConfig, torch_dtype: str = "float32") -> dict[str, Any]:
    """The config.json HF transformers (and brisk) read back for `cfg`."""
    arch_class = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
    out: dict[str, Any] = {
        "architectures": [arch_class[cfg.architecture]],
        "model_type": "gemma3_text" if cfg.architecture == "gemma3" else cfg.architecture,
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
        "hidden_act": {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}[cfg.hidden_act],
        "torch_dtype": torch_dtype,
    }
    if cfg.layer_types:
        out["layer_types"] = [f"{t}_attention" for t in cfg.layer_types]
        out["sliding_window"] = cfg.sliding_window
        out["use_sliding_window"] = True
    if cfg.architecture == "gemma3":
        scalar = cfg.query_pre_attn_scalar
        out.update(hidden_activation=out["hidden_act"], query_pre_attn_scalar=int(scalar) if scalar.is_integer() else scalar,
                   rope_local_base_freq=cfg.rope_local_theta,
                   final_logit_softcapping=cfg.final_logit_softcapping or None)
    if cfg.rotary_dim < cfg.head_dim:
        out["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
    if cfg.rope_scaling.rope_type == "longrope":
        out["original_max_position_embeddings"] = cfg.rope_scaling.original_max_position_embeddings
    if not cfg.uniform or cfg.output_bias:
        out[LAYERS_KEY] = {"num_attention_heads": list(cfg.layer_heads), "num_key_value_heads": list(cfg.layer_kv_heads),
                           "intermediate_size": list(cfg.layer_intermediate), "output_bias": cfg.output_bias}
    if cfg.bos_token_id is not None:
        out["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_id is not None:
        out["eos_token_id"] = cfg.eos_token_id
    return out
