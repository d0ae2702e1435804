"""GGUF blocks kept quantized at run time: Q4_0, Q4_1 and Q8_0 become `GroupLinear`s as they are.

A GGUF Q4_1 block is 32 columns: fp16 d, fp16 m, 16 bytes of nibbles (low nibble = column j,
high = column j + 16), w = q d + m; Q4_0 has no m and w = (q - 8) d; Q8_0 is fp16 d and 32 int8,
w = q d. That is GroupLinear's layout with group 32 (scale d, zero m or -8 d), so the nibbles are
used where they lie, and d and m stay float16. q d is exact in float32 (4 or 8 bits times
fp16's 11), and the kernel's one fma rounds q d + m once as ggml does, so the weights are the very
values the dequantizing loader produces.

A Linear whose parts are not all of these types (e.g. Q6_K, or Q4_1 beside Q8_0 in one stacked
projection) stays the float copy the loader made.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from gguf import GGMLQuantizationType
from torch import nn

from brisk.quant.grouped import GroupLinear

GROUP = 32
# type -> (block bytes, has m, 4-bit)
NATIVE = {GGMLQuantizationType.Q4_0: (18, False, True), GGMLQuantizationType.Q4_1: (20, True, True),
          GGMLQuantizationType.Q8_0: (34, False, False)}

Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]  # q, scale, zero, bits


def is_native(ggml_type: int) -> bool:
    return ggml_type in NATIVE


def to_group(ggml_type: int, raw: torch.Tensor) -> Parts:
    """uint8 [rows, blocks * block bytes] -> GroupLinear's (q, scale, zero, bits), group 32."""
    size, has_m, four_bit = NATIVE[GGMLQuantizationType(ggml_type)]
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, size)  # [rows, n_blocks, size]
    d = blocks[..., 0:2].contiguous().view(torch.float16).reshape(rows, -1)  # [rows, n_blocks]
    start = 4 if has_m else 2
    qs = blocks[..., start:].contiguous().reshape(rows, -1)
    if not four_bit:
        return qs.view(torch.int8), d.contiguous(), None, 8
    zero = blocks[..., 2:4].contiguous().view(torch.float16).reshape(rows, -1) if has_m else -8 * d  # exact
    return qs, d.contiguous(), zero.contiguous(), 4


def _group_linear(parts: list[Parts], output_sizes: tuple[int, ...], bias: torch.Tensor | None,
                  weight: torch.Tensor) -> GroupLinear:
    """The parts' rows stacked into one GroupLinear on `weight`'s device, for its dtype."""
    device = weight.device  # the file's rows are on the CPU; the model may not be
    q = torch.cat([p[0] for p in parts]).contiguous().to(device)
    scale = torch.cat([p[1] for p in parts]).contiguous().to(device)
    zero = None if parts[0][2] is None else torch.cat([p[2] for p in parts]).contiguous().to(device)  # type: ignore[misc]
    bias = None if bias is None else bias.detach().float()
    return GroupLinear(q, scale, zero, GROUP, parts[0][3], bias, output_sizes, weight.dtype)


def apply_gguf(model: nn.Module, raw: Iterable[tuple[str, int, torch.Tensor]]) -> dict[str, int]:
    """Swap in GroupLinears built from a GGUF file's native blocks ((HF name, type, rows) triples,
    q/k rows already in HF order). Returns how many Linears run native and how many stay float."""
    from brisk.quant import drop_plan, quantizable, tie_head

    drop_plan(model)
    found: dict[str, dict[int, Parts]] = {}
    tied_head: Parts | None = None
    for name, ggml_type, rows in raw:
        if name.removeprefix("model.") == "embed_tokens.weight":
            if getattr(model, "lm_head", "absent") is None:
                tied_head = to_group(ggml_type, rows)
            continue
        target = model.linear_part(name)  # type: ignore[operator]
        if target is not None:
            found.setdefault(target[0], {})[target[1]] = to_group(ggml_type, rows)
    native = 0
    names = {id(m): n for n, m in model.named_modules()}
    for parent, attr, linear in quantizable(model):
        got = found.get(names[id(linear)], {})
        parts = [got[i] for i in range(len(linear.output_sizes)) if i in got]
        if len(parts) == len(linear.output_sizes) and len({p[3] for p in parts}) == 1:
            setattr(parent, attr, _group_linear(parts, linear.output_sizes, linear.bias, linear.weight))
            native += 1
    if tied_head is not None:
        embed = model.embed_tokens.weight  # type: ignore[union-attr]
        tie_head(model, _group_linear([tied_head], (embed.shape[0],), None, embed))
        native += 1
    return {"native": native, "float": len(quantizable(model))}
