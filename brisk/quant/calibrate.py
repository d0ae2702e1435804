"""Calibration statistics for int4 (GPTQ, quant/gptq.py) and w8a8 (SmoothQuant, quant/w8a8.py):
what the decoder's Linears see over a few thousand tokens of text.

Activations come from forwards of the float model over the calibration tokens, in windows no
longer than the model's positions (hooks on every Linear's input); the model is not changed.
Per Linear only statistics are kept: max |x| per channel (SmoothQuant) and X^T X (GPTQ's Hessian).

AWQ-style column scaling (Lin et al., 2023) ran before GPTQ here until the clipping search and
act-order GPTQ arrived; then it made the default model worse (8,192 WikiText tokens, g64: KL to
float32 0.068 without it, 0.084 with it), so int4 calibrates with GPTQ alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from brisk.errors import UserError
from brisk.model.layers import Linear
from brisk.model.base import forward_sequence

WINDOW = 1024  # tokens per calibration forward (fewer when the model's positions are fewer)


@dataclass
class InputStats:
    """What a Linear's calibration inputs leave behind (float32)."""

    rows: int = 0
    abs_max: torch.Tensor | None = None  # [in]
    xtx: torch.Tensor | None = None  # [in, in], when kept

    def add(self, x: torch.Tensor, keep_xtx: bool) -> None:
        a = x.abs()
        self.abs_max = a.amax(dim=0) if self.abs_max is None else torch.maximum(self.abs_max, a.amax(dim=0))
        if keep_xtx:
            self.xtx = x.T @ x if self.xtx is None else self.xtx.addmm_(x.T, x)
        self.rows += x.shape[0]


@torch.inference_mode()
def collect_stats(model: nn.Module, ids: list[int], keep_xtx: bool = False) -> dict[Linear, InputStats]:
    """Input statistics of every decoder Linear over `ids`, forwarded in windows of <= WINDOW."""
    positions = model.max_positions
    window = min(WINDOW, positions)
    stats: dict[Linear, InputStats] = {}
    linears = [m for name, m in model.named_modules() if isinstance(m, Linear) and name != "lm_head"]

    def hook(mod: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0].float().reshape(-1, args[0].shape[-1])
        stats.setdefault(mod, InputStats()).add(x, keep_xtx)  # type: ignore[arg-type]

    hooks = [m.register_forward_pre_hook(hook) for m in linears]
    try:
        for start in range(0, len(ids), window):
            forward_sequence(model, ids[start:start + window])
    finally:
        for h in hooks:
            h.remove()
    return stats


def gptq_calibrate(model: nn.Module, ids: list[int]) -> dict[Linear, tuple[None, torch.Tensor]]:
    """Per decoder Linear: (no column scale, GPTQ's Hessian X^T X / n of its calibration inputs)."""
    if len(ids) < 16:
        raise UserError(f"int4 calibration needs at least 16 tokens of text, got {len(ids)}")
    out: dict[Linear, tuple[None, torch.Tensor]] = {}
    for linear, stats in collect_stats(model, ids, keep_xtx=True).items():
        assert stats.xtx is not None
        out[linear] = (None, stats.xtx / stats.rows)
        stats.xtx = None  # do not hold every Hessian twice
    return out
