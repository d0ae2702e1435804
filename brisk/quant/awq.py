"""AWQ-style activation-aware scaling for int4 (Lin et al., 2023), from a few hundred tokens.

A few input channels meet much larger activations than the rest; rounding errors in the weight
columns they multiply cost the most. Scaling column i of W by s_i before quantizing (and dividing
x_i by s_i at run time, `GroupLinear.input_scale`) gives those columns more of the 4-bit grid.
Per Linear, s = mean|x|^alpha (normalised), with alpha picked from a grid by the output error
|| X W^T - X (Q(W s) / s)^T ||^2 on the calibration activations; alpha = 0 is plain
round-to-nearest, so the search never does worse than RTN on the calibration rows.

Activations come from one forward of the float model over the calibration tokens (hooks on every
Linear's input); the model itself is not changed here.
"""

from __future__ import annotations

import torch
from torch import nn

from brisk.model.attention import ContiguousAttention, SeqSpan
from brisk.model.layers import Linear
from brisk.quant.grouped import dequantize_reference, quantize_rtn_4bit

ALPHAS = [i / 10 for i in range(11)]
MAX_ROWS = 256  # calibration rows kept per Linear for the error (memory: rows x in floats each)


@torch.inference_mode()
def collect_inputs(model: nn.Module, ids: list[int]) -> dict[Linear, torch.Tensor]:
    """Every decoder Linear's input rows [n, in] (float32) over one forward of `ids`."""
    seen: dict[Linear, torch.Tensor] = {}
    linears = [m for name, m in model.named_modules() if isinstance(m, Linear) and name != "lm_head"]
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.__setitem__(mod, args[0].float().reshape(
        -1, args[0].shape[-1]))) for m in linears]
    try:
        cfg = model.config  # type: ignore[attr-defined]
        n, device, dtype = len(ids), model.device, model.dtype  # type: ignore[attr-defined]
        shape = (1, cfg.num_key_value_heads, n, cfg.head_dim)
        caches = [(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
                  for _ in range(cfg.num_hidden_layers)]
        model(torch.tensor(ids, device=device), torch.arange(n, device=device),
              ContiguousAttention(caches, [SeqSpan(0, 0, n, 0)]))
    finally:
        for h in hooks:
            h.remove()
    return seen


def _best_scale(weight: torch.Tensor, x: torch.Tensor, group: int) -> torch.Tensor | None:
    """The s minimising the output error over the alpha grid; None when alpha = 0 (RTN) wins."""
    w = weight.float()
    rows = x[torch.linspace(0, x.shape[0] - 1, min(MAX_ROWS, x.shape[0])).long()]  # spread over the text
    ref = rows @ w.T
    x_mean = x.abs().mean(dim=0).clamp(min=1e-6)  # [in]
    best_err, best = float("inf"), None
    for alpha in ALPHAS:
        s = x_mean.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # centred around 1 so neither end of the grid overflows
        q, scale, zero = quantize_rtn_4bit(w * s, group)
        w_eff = dequantize_reference(q, scale, zero, group, 4) / s
        err = float(((rows @ w_eff.T - ref) ** 2).mean())
        if err < best_err:
            best_err, best = err, (None if alpha == 0 else s)
    return best


def awq_scales(model: nn.Module, ids: list[int], group: int) -> dict[Linear, torch.Tensor]:
    """Per decoder Linear, the column scales s to quantize W * s with (absent: plain RTN)."""
    if len(ids) < 16:
        raise ValueError(f"AWQ calibration needs at least 16 tokens of text, got {len(ids)}")
    inputs = collect_inputs(model, ids)
    scales = {}
    for linear, x in inputs.items():
        s = _best_scale(linear.weight, x, group)
        if s is not None:
            scales[linear] = s
    return scales
