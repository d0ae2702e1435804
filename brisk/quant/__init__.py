"""Quantization: methods that swap the model's Linear modules (ARCHITECTURE habit 4).

`apply(model, method)` replaces every `Linear` of the decoder layers with the method's module;
architecture files never know. Methods register themselves in `METHODS` by name.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from brisk.model.layers import Linear
from brisk.quant.int8 import Int8Linear

METHODS: dict[str, Callable[[Linear], nn.Module]] = {"int8": Int8Linear.from_linear}


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; available: {', '.join(sorted(METHODS))}")


def apply(model: nn.Module, method: str) -> int:
    """Quantize every Linear below `model` in place (an untied LM head too); returns how many were
    swapped. A tied LM head is the embedding matrix and stays in the model's dtype."""
    check_method(method)
    make = METHODS[method]
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, Linear)]
    for parent, name, child in targets:
        setattr(parent, name, make(child))
    return len(targets)
