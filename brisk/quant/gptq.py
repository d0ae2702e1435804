"""GPTQ rounding for int4 groups (Frantar et al., 2022), from the calibration activations.

Round-to-nearest rounds every weight on its own. GPTQ rounds the columns of W one at a time and
spreads each column's rounding error over the columns not yet rounded, weighted by the inverse
Hessian of the layer's squared output error, H = 2 X^T X / n: the error that a later column can
cancel, it cancels. Group scale and offset are fixed from the (already updated) weights when the
sweep enters a group, as in the reference implementation; the output is GroupLinear's format
(4-bit, float16 scale and offset), so the kernels and the checkpoint are the same as RTN's.
"""

from __future__ import annotations

import torch

from brisk.quant.grouped import check_group, group_params, pack_nibbles

BLOCK = 128  # columns updated together (lazy batch updates); a multiple of every group size used
# Added to the Hessian's diagonal, as a fraction of its mean. GPTQ's usual 0.01 assumes ~10^5
# calibration tokens; with a few thousand it overfits them (held-out output error above RTN's on
# SmolLM2). 1.0 was best on held-out text for 3 of 4 projections at 4,096 tokens (measured).
DAMP = 1.0


def _inverse_hessian(xtx: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Upper Cholesky factor of H^-1 (float32), and the columns no calibration input touched."""
    h = 2 * xtx.double()  # [in, in]; the mean of x^T x over the calibration rows
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    h += DAMP * torch.diag(h).mean() * torch.eye(in_features, dtype=h.dtype, device=h.device)
    hinv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(hinv, upper=True).float(), dead


def gptq_quantize(weight: torch.Tensor, xtx: torch.Tensor, group: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] and X^T X / n [in, in] of its calibration inputs -> (packed q, scale, zero)
    as quantize_rtn_4bit."""
    out, in_features = weight.shape
    check_group(in_features, group)
    block = BLOCK if BLOCK % group == 0 else group
    cpu = torch.device("cpu")  # a sequential sweep of small ops: the CPU, wherever the model lives
    w = weight.detach().float().to(cpu).clone()
    hinv, dead = _inverse_hessian(xtx.to(cpu), in_features)
    w[:, dead] = 0
    column_weight = torch.diagonal(xtx).float().to(cpu)  # the inputs' mean square per column
    q = torch.zeros(out, in_features, dtype=torch.uint8, device=cpu)
    scale = torch.zeros(out, in_features // group, dtype=torch.float16, device=cpu)
    zero = torch.zeros_like(scale)
    for b0 in range(0, in_features, block):
        b1 = min(b0 + block, in_features)
        wb, hb = w[:, b0:b1], hinv[b0:b1, b0:b1]  # a view: updates land in w
        err = torch.zeros(out, b1 - b0, device=cpu)
        for i in range(b1 - b0):
            col = b0 + i
            if col % group == 0:
                s, z = group_params(wb[:, i:i + group], column_weight[col:col + group])
                scale[:, col // group], zero[:, col // group] = s, z
            s, z = scale[:, col // group].float(), zero[:, col // group].float()
            qc = torch.round((wb[:, i] - z) / s).clamp_(0, 15)
            q[:, col] = qc.to(torch.uint8)
            e = (wb[:, i] - (qc * s + z)) / hb[i, i]
            wb[:, i:] -= e[:, None] * hb[i, i:][None, :]
            err[:, i] = e
        w[:, b1:] -= err @ hinv[b0:b1, b1:]
    dev = weight.device
    return pack_nibbles(q).to(dev), scale.contiguous().to(dev), zero.contiguous().to(dev)
