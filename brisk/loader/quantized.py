"""Quantized checkpoints: `brisk quantize` writes one, `load_model` reads it back.

A quantized directory is an HF-style directory (config.json, tokenizer files) whose
`model.safetensors` holds brisk's own module state (fused projections, int8 weights and their
scales) and whose `quantization.json` names the method. Loading builds the model, swaps in the
method's modules and fills them with the saved tensors: no re-quantization, bit-identical results.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from brisk.config import CALIBRATED_METHODS, QuantConfig
from brisk.errors import UserError
from brisk.loader.hf_loader import hf_config_dict
from brisk.model.base import CausalLM
from brisk.quant import apply
from brisk.quant.grouped import shapes_only

MARKER = "quantization.json"


def quantization_of(path: Path) -> QuantConfig | None:
    """How a quantized checkpoint directory was quantized; None for any other model."""
    marker = path / MARKER
    if not path.is_dir() or not marker.is_file():
        return None
    try:
        saved = json.loads(marker.read_text(encoding="utf-8"))
        method = saved.pop("method")
        saved.pop("format", None)
        if saved.get("calibration", "") is None:  # written when uncalibrated was the default
            saved["calibration"] = "none"
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"{marker} is unreadable ({exc}); re-run `brisk quantize`") from None
    try:
        return QuantConfig.parse(method, saved)
    except (ValueError, TypeError) as exc:
        raise UserError(f"{path} was quantized with {method!r}, which this brisk cannot load: {exc}") from None


def save_quantized(model: CausalLM, quant: QuantConfig, out: Path, dtype: str) -> None:
    """Write the quantized model's state next to its config (the caller writes the tokenizer)."""
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "brisk", "quantization": quant.method})
    (out / "config.json").write_text(json.dumps(hf_config_dict(model.config, dtype), indent=2) + "\n")
    marker = {"method": quant.method, "format": "brisk", **_options(quant)}
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _options(quant: QuantConfig) -> dict[str, object]:
    if quant.method not in CALIBRATED_METHODS:
        return {}
    acts = {"activations": quant.act_mode} if quant.method == "int4" else {}  # explicit: the default changed once
    return {"group_size": quant.group, "calibration": quant.calibration,
            "calibration_tokens": quant.calibration_tokens, **acts}


def load_quantized_state(model: CausalLM, path: Path, quant: QuantConfig) -> None:
    """Swap in the method's modules, then fill every parameter and buffer from the checkpoint."""
    fill_quantized_state(model, load_file(str(path / "model.safetensors")), quant, path)


def fill_quantized_state(model: CausalLM, state: dict[str, torch.Tensor], quant: QuantConfig, path: Path) -> None:
    """Swap in the method's modules, then fill every parameter and buffer from `state` (read
    from the checkpoint or cache entry `path`)."""
    with shapes_only():
        apply(model, quant)  # the modules' shapes; their contents are replaced just below
    # written before tied heads were shared with the lookups: the float embedding is not needed now
    if model.config.tie_word_embeddings and "embed_tokens.weight" not in model.state_dict():
        state.pop("embed_tokens.weight", None)  # (a method that keeps the head float keeps the embedding)
    try:
        for name in state:
            if name.endswith(".input_scale"):  # AWQ-scaled / smoothed Linears carry one more buffer
                model.get_submodule(name.rpartition(".")[0]).set_input_scale(state[name])
        missing, unexpected = model.load_state_dict(state, strict=False)
    except (AttributeError, RuntimeError) as exc:
        raise UserError(f"{path} does not match a {quant.method} model of its config ({exc}); "
                         "re-run `brisk quantize`") from None
    if missing or unexpected:
        raise UserError(f"{path} does not match a {quant.method} model of its config (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}); re-run `brisk quantize`")
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name in state and buf.dtype != state[name].dtype:
                raise UserError(f"{path}: {name} is {state[name].dtype}, expected {buf.dtype}")
