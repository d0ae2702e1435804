"""Quantization: methods that swap the model's Linear modules (ARCHITECTURE habit 4).

`apply(model, method)` replaces every `Linear` of the decoder layers with the method's module;
architecture files never know. Methods register themselves in `METHODS` by name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from brisk.model.layers import Linear
from brisk.quant.int8 import Int8Linear

METHODS: dict[str, Callable[[Linear], nn.Module]] = {"int8": Int8Linear.from_linear}


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; available: {', '.join(sorted(METHODS))}")


def apply(model: nn.Module, method: str) -> int:
    """Quantize every Linear below `model` in place, and the LM head; returns how many were swapped.

    A tied LM head is the embedding matrix: the head gets its own quantized copy (every decode
    step reads the whole head, 21% of SmolLM2's bytes) while lookups keep the embedding as is.
    """
    check_method(method)
    make = METHODS[method]
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, Linear)]
    for parent, name, child in targets:
        setattr(parent, name, make(child))
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", "absent") is None and embed is not None:
        head = Linear(embed.weight.shape[1], (embed.weight.shape[0],), dtype=embed.weight.dtype)
        with torch.no_grad():
            head.weight.copy_(embed.weight)
        model.lm_head = make(head)  # type: ignore[assignment]
        targets.append((model, "lm_head", head))
    return len(targets)
