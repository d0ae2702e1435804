"""Quantization: methods that swap the model's Linear modules (ARCHITECTURE habit 4).

`apply(model, QuantConfig)` replaces every `Linear` of the decoder layers with the method's module
and quantizes the LM head; architecture files never know. Each method is one object in
`METHODS` (quant/methods.py: its makers for the decoder's Linears and the head, its calibration,
its tensor-parallel shard widths). "gguf" is not made here: it keeps a GGUF file's own blocks,
which only the loader has (quant/gguf.py, `attach_blocks`).

A tied LM head (SmolLM2) is the embedding matrix. Every decode step reads the whole head (21% of
SmolLM2's bytes), so it is quantized too, and token lookups then read rows of that quantized head
(`HeadEmbedding`): one copy of the matrix instead of a float embedding beside a quantized head.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from brisk.config import QuantConfig
from brisk.errors import UserError
from brisk.model.layers import Linear
from brisk.quant.base import FollowDtype
from brisk.quant.grouped import GroupLinear
from brisk.quant.methods import METHODS, Calibrated, Maker, QuantMethod, method

__all__ = ["METHODS", "HeadEmbedding", "QuantMethod", "apply", "check_method", "modules_changed", "method", "quantizable",
           "set_activations", "tie_head"]


def check_method(method: str) -> None:
    """ValueError naming the available methods unless `method` is one (QuantConfig's own check)."""
    QuantConfig(method)


class HeadEmbedding(FollowDtype):
    """Token lookups that read rows of the quantized tied LM head (its only copy)."""

    def __init__(self, head: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        object.__setattr__(self, "_head", head)  # not a submodule: the model owns it as lm_head
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._head.dequantize_rows(ids).to(self.dtype)  # type: ignore[operator]


def quantizable(model: nn.Module) -> list[tuple[nn.Module, str, Linear]]:
    """(parent, attribute, Linear) for every Linear below `model`."""
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, Linear)]


def apply(model: nn.Module, cfg: QuantConfig | str, calibration_ids: list[int] | None = None) -> int:
    """Quantize every Linear below `model` in place, and the LM head; returns how many were swapped.

    With `calibration_ids`: GPTQ rounding for int4 (quant/gptq.py, from quant/calibrate.py's
    statistics); SmoothQuant for w8a8 (quant/w8a8.py), which scales weight columns and divides
    the inputs at run time."""
    cfg = QuantConfig(cfg) if isinstance(cfg, str) else cfg
    m = method(cfg)
    if m.make is None:
        raise UserError(f"{cfg.method} keeps a GGUF file's own blocks: load a .gguf model with it")
    modules_changed(model)
    with _made_on(next(model.parameters()).device):  # the Linears made here (tied head, scaled copies)
        return _apply(model, cfg, calibration_ids, m)


def _made_on(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Where new tensors go during quantization: `device` when it is not already the default. A
    device context sends every torch call through a Python __torch_function__ mode (~20 us each),
    and GPTQ's and SparseGPT's column sweeps make ~1.6 million calls on the default model: on the
    CPU, which needs no context, a 2:4 SparseGPT pass of it took 46 s with one, 36-40 s without."""
    if device == torch.get_default_device():
        return contextlib.nullcontext()
    return torch.device(device)


def _apply(model: nn.Module, cfg: QuantConfig, calibration_ids: list[int] | None, m: QuantMethod) -> int:
    make_linear: Maker = m.make  # type: ignore[assignment]
    make_head = m.make_head
    calibrated: Calibrated = {}
    if calibration_ids is not None:
        calibrated = m.calibrate(model, calibration_ids)
    targets = [t for t in quantizable(model) if make_head is not None or not (t[0] is model and t[1] == "lm_head")]
    for parent, name, child in targets:
        is_head = parent is model and name == "lm_head"
        scale, inputs = calibrated.get(child, (None, None))
        module = (make_head if is_head and make_head is not None else make_linear)(_scaled(child, scale), cfg, inputs)
        if scale is not None:
            module.set_input_scale(1.0 / scale)  # type: ignore[operator]
            module.dtype = child.weight.dtype  # the scaled copy is float32; activations keep the model's dtype
        setattr(parent, name, module)
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", "absent") is None and embed is not None and make_head is not None:
        head = Linear(embed.weight.shape[1], (embed.weight.shape[0],), dtype=embed.weight.dtype)
        with torch.no_grad():
            head.weight.copy_(embed.weight)
        tie_head(model, make_head(head, cfg, None))
        targets.append((model, "lm_head", head))
    return len(targets)


def set_activations(model: nn.Module, mode: str) -> None:
    """What every group-quantized Linear (int4, gguf, the 8-bit heads) multiplies its weights by:
    "float" activations or "int16" / "int8" ones in integer dot products (QuantConfig.activations)."""
    for m in model.modules():
        if isinstance(m, GroupLinear):
            m.activations = mode
    modules_changed(model)  # a C++ decode plan captured the old mode


def modules_changed(model: nn.Module) -> None:
    """Tell `model` (a `CausalLM`; any other module has nothing to tell) that its modules are
    changing: a runner's decode plan and CUDA graphs over them are built again."""
    changed = getattr(model, "modules_changed", None)
    if changed is not None:
        changed()


def tie_head(model: nn.Module, head: nn.Module) -> None:
    """Make `head` the LM head and the source of token lookups (the float embedding is dropped)."""
    dtype = model.embed_tokens.weight.dtype  # type: ignore[union-attr]
    model.lm_head = head  # type: ignore[assignment]
    model.embed_tokens = HeadEmbedding(head, dtype)  # type: ignore[assignment]


def _scaled(linear: Linear, scale: torch.Tensor | None) -> Linear:
    """`linear` with its input columns multiplied by `scale` (SmoothQuant); the input is divided at run time."""
    if scale is None:
        return linear
    out = Linear(linear.in_features, linear.output_sizes, linear.bias is not None, torch.float32)
    with torch.no_grad():
        out.weight.copy_(linear.weight.float() * scale)
        if linear.bias is not None:
            out.bias.copy_(linear.bias)  # type: ignore[union-attr]
    return out
