"""Quantization: methods that swap the model's Linear modules (ARCHITECTURE habit 4).

`apply(model, QuantConfig)` replaces every `Linear` of the decoder layers with the method's module
and quantizes the LM head; architecture files never know. Each method registers a pair of makers
in `METHODS`: one for the decoder's Linears, one for the head. "gguf" is not made here: it keeps a
GGUF file's own blocks, which only the loader has (quant/gguf.py, `apply_gguf`).

A tied LM head (SmolLM2) is the embedding matrix. Every decode step reads the whole head (21% of
SmolLM2's bytes), so it is quantized too, and token lookups then read rows of that quantized head
(`HeadEmbedding`): one copy of the matrix instead of a float embedding beside a quantized head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from brisk.config import QUANT_METHODS, QuantConfig
from brisk.errors import UserError
from brisk.model.layers import Linear
from brisk.quant.base import FollowDtype
from brisk.quant.grouped import GroupLinear
from brisk.quant.int8 import Int8Linear
from brisk.quant.sparse24 import Sparse24Linear
from brisk.quant.ternary import TernaryLinear
from brisk.quant.w8a8 import W8A8Linear

# (Linear, config, X^T X / n of its calibration inputs or None) -> quantized module
Maker = Callable[[Linear, QuantConfig, "torch.Tensor | None"], nn.Module]


Calibrated = dict[Linear, tuple["torch.Tensor | None", "torch.Tensor | None"]]  # column scale, X^T X / n

# method -> (decoder Linear maker, LM head maker). int4's head is 8-bit in groups of 32 (GGUF's
# Q8_0, what llama.cpp's own Q4 files keep for token_embd): the head sees every logit, and 4 bits
# there cost more quality than the 14 MB they save.
METHODS: dict[str, tuple[Maker, Maker | None]] = {  # head maker None: the head stays as it is
    "int8": (lambda lin, cfg, x: Int8Linear.from_linear(lin), lambda lin, cfg, x: Int8Linear.from_linear(lin)),
    "int4": (lambda lin, cfg, x: GroupLinear.from_linear(lin, cfg.group_size, 4, calibration=x),
             lambda lin, cfg, x: GroupLinear.from_linear(lin, 32, 8)),
    "w8a8": (lambda lin, cfg, x: W8A8Linear.from_linear(lin), lambda lin, cfg, x: W8A8Linear.from_linear(lin)),
    # ternary's head stays 8-bit (Q8_0-like) as BitNet keeps its embedding and head in high precision
    "ternary": (lambda lin, cfg, x: TernaryLinear.from_linear(lin),
                lambda lin, cfg, x: GroupLinear.from_linear(lin, 32, 8)),
    # 2:4 sparsity (quant/sparse24.py; compress/ prunes with it): SparseGPT from the calibration
    # Hessian. The head is not made sparse: float32 stays the model's own head, int8 gets int8's,
    # so each compares with the dense model of the same dtype.
    "sparse24": (lambda lin, cfg, x: Sparse24Linear.from_linear(lin, x), None),
    "sparse24_int8": (lambda lin, cfg, x: Sparse24Linear.from_linear(lin, x, int8=True),
                      lambda lin, cfg, x: Int8Linear.from_linear(lin)),
}
assert set(METHODS) | {"gguf"} == set(QUANT_METHODS)


def _calibrator(method: str) -> Callable[[nn.Module, list[int]], Calibrated]:
    """From calibration text: GPTQ's Hessians for int4, SmoothQuant's migration for w8a8."""
    if method in ("int4", "sparse24", "sparse24_int8"):  # GPTQ's and SparseGPT's Hessians
        from brisk.quant.calibrate import gptq_calibrate

        return gptq_calibrate  # type: ignore[return-value]
    from brisk.quant.w8a8 import smoothquant_calibrate

    return smoothquant_calibrate


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
    if cfg.method not in METHODS:
        raise UserError(f"{cfg.method} keeps a GGUF file's own blocks: load a .gguf model with it")
    make_linear, make_head = METHODS[cfg.method]
    drop_plan(model)
    device = next(model.parameters()).device
    with torch.device(device):  # the Linears made here (tied head, scaled copies) go where the model is
        return _apply(model, cfg, calibration_ids, make_linear, make_head)


def _apply(model: nn.Module, cfg: QuantConfig, calibration_ids: list[int] | None, make_linear: Maker,
           make_head: Maker | None) -> int:
    calibrated: Calibrated = {}
    if calibration_ids is not None:
        calibrated = _calibrator(cfg.method)(model, calibration_ids)
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
    drop_plan(model)  # a C++ decode plan captured the old mode


def drop_plan(model: nn.Module) -> None:
    """Forget `model`'s C++ decode plan (model/decode_plan.py): its modules are changing."""
    drop = getattr(model, "drop_decode_plan", None)
    if drop is not None:
        drop()


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
