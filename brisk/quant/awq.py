"""Calibration for int4 and w8a8: activation statistics from a few thousand tokens of text, and
AWQ-style activation-aware scaling for int4 (Lin et al., 2023), whose scaled weights GPTQ then
rounds (quant/gptq.py).

A few input channels meet much larger activations than the rest; rounding errors in the weight
columns they multiply cost the most. Scaling column i of W by s_i before quantizing (and dividing
x_i by s_i at run time, `GroupLinear.input_scale`) gives those columns more of the 4-bit grid.
Per Linear, s = mean|x|^alpha (normalised), with alpha picked from a grid by the output error
|| X W^T - X (Q(W s) / s)^T ||^2 on calibration rows; alpha = 0 is plain round-to-nearest.

Activations come from forwards of the float model over the calibration tokens, in windows no
longer than the model's positions (hooks on every Linear's input); the model is not changed.
Per Linear only statistics are kept: mean and max |x| per channel, X^T X (GPTQ's Hessian), and
up to 256 rows spread over the text for the alpha search.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from brisk.model.layers import Linear
from brisk.model.llama import forward_sequence
from brisk.quant.grouped import dequantize_reference, quantize_rtn_4bit

ALPHAS = [i / 10 for i in range(11)]
MAX_ROWS = 256  # calibration rows kept per Linear for the alpha search
WINDOW = 1024  # tokens per calibration forward (fewer when the model's positions are fewer)


@dataclass
class InputStats:
    """What a Linear's calibration inputs leave behind (float32)."""

    rows: int = 0
    abs_sum: torch.Tensor | None = None  # [in]
    abs_max: torch.Tensor | None = None  # [in]
    xtx: torch.Tensor | None = None  # [in, in], when kept
    sample: list[torch.Tensor] = field(default_factory=list)  # rows for the alpha search

    def add(self, x: torch.Tensor, keep_xtx: bool, every: int) -> None:
        a = x.abs()
        self.abs_sum = a.sum(dim=0) if self.abs_sum is None else self.abs_sum + a.sum(dim=0)
        self.abs_max = a.amax(dim=0) if self.abs_max is None else torch.maximum(self.abs_max, a.amax(dim=0))
        if keep_xtx:
            self.xtx = x.T @ x if self.xtx is None else self.xtx.addmm_(x.T, x)
        self.sample.append(x[::every])
        self.rows += x.shape[0]

    @property
    def abs_mean(self) -> torch.Tensor:
        assert self.abs_sum is not None
        return self.abs_sum / self.rows

    def rows_for_search(self) -> torch.Tensor:
        return torch.cat(self.sample)[:MAX_ROWS]


@torch.inference_mode()
def collect_stats(model: nn.Module, ids: list[int], keep_xtx: bool = False) -> dict[Linear, InputStats]:
    """Input statistics of every decoder Linear over `ids`, forwarded in windows of <= WINDOW."""
    positions = int(model.rope_cos.shape[0])  # type: ignore[attr-defined]
    window = min(WINDOW, positions)
    every = max(1, len(ids) // MAX_ROWS)  # keep ~MAX_ROWS rows spread over the whole text
    stats: dict[Linear, InputStats] = {}
    linears = [m for name, m in model.named_modules() if isinstance(m, Linear) and name != "lm_head"]

    def hook(mod: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0].float().reshape(-1, args[0].shape[-1])
        stats.setdefault(mod, InputStats()).add(x, keep_xtx, every)  # type: ignore[arg-type]

    hooks = [m.register_forward_pre_hook(hook) for m in linears]
    try:
        for start in range(0, len(ids), window):
            forward_sequence(model, ids[start:start + window])
    finally:
        for h in hooks:
            h.remove()
    return stats


def _best_scale(weight: torch.Tensor, stats: InputStats, group: int) -> torch.Tensor | None:
    """The s minimising the output error over the alpha grid; None when alpha = 0 (RTN) wins."""
    w = weight.float()
    rows = stats.rows_for_search().to(w.device)
    ref = rows @ w.T
    x_mean = stats.abs_mean.clamp(min=1e-6).to(w.device)  # [in]
    best_err, best = float("inf"), None
    for alpha in ALPHAS:
        s = x_mean.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # centred around 1 so neither end of the grid overflows
        q, scale, zero = quantize_rtn_4bit(w * s, group, search=False)  # min/max: 11 alphas stay cheap
        w_eff = dequantize_reference(q, scale, zero, group, 4) / s
        err = float(((rows @ w_eff.T - ref) ** 2).mean())
        if err < best_err:
            best_err, best = err, (None if alpha == 0 else s)
    return best


def awq_calibrate(model: nn.Module, ids: list[int], group: int
                  ) -> dict[Linear, tuple[torch.Tensor | None, torch.Tensor]]:
    """Per decoder Linear: the column scales s to quantize W * s with (None: unscaled), and GPTQ's
    Hessian X^T X / n of the inputs as the scaled weight sees them (x / s)."""
    if len(ids) < 16:
        raise ValueError(f"AWQ calibration needs at least 16 tokens of text, got {len(ids)}")
    out: dict[Linear, tuple[torch.Tensor | None, torch.Tensor]] = {}
    for linear, stats in collect_stats(model, ids, keep_xtx=True).items():
        s = _best_scale(linear.weight, stats, group)
        assert stats.xtx is not None
        h = stats.xtx / stats.rows
        out[linear] = (s, h if s is None else h / (s[:, None] * s[None, :]))
        stats.xtx = None  # the next Linear's turn: do not hold every Hessian twice
    return out
