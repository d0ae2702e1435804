"""GPTQ rounding for int4 groups (Frantar et al., 2022), from the calibration activations.

Round-to-nearest rounds every weight on its own. GPTQ rounds the columns of W one at a time and
spreads each column's rounding error over the columns not yet rounded, weighted by the inverse
Hessian of the layer's squared output error, H = 2 X^T X / n: the error that a later column can
cancel, it cancels. Columns go in act-order, the largest inputs first (while the most columns are
left to absorb their error), and every group's scale and offset are fixed beforehand from the
unchanged weights ("static groups", so act-order needs no regrouping) by the clipping search of
`group_params`, weighted by each column's mean square input. On the default model at g64 (8,192
WikiText tokens) this took the KL to float32 from 0.086 (weights' own order, grids fitted as the
sweep entered each group) to 0.068. The output is GroupLinear's format (4-bit, float16 scale and
offset), so the kernels and the checkpoint are the same as round-to-nearest's.
"""

from __future__ import annotations

import torch

from brisk.quant.grouped import check_group, group_params, pack_nibbles

BLOCK = 128  # columns updated together (lazy batch updates)
# Added to the Hessian's diagonal, as a fraction of its mean. GPTQ's usual 0.01 assumes ~10^5
# calibration tokens; with a few thousand it overfits them (held-out output error above RTN's on
# SmolLM2). 1.0 was best on held-out text for 3 of 4 projections at 4,096 tokens (measured); with
# act-order, 0.1 gave KL to float32 0.071 against 1.0's 0.068 (8,192 WikiText tokens).
DAMP = 1.0


def _inverse_hessian(xtx: torch.Tensor, in_features: int, damp: float = DAMP) -> tuple[torch.Tensor, torch.Tensor]:
    """Upper Cholesky factor of H^-1 (float32), and the columns no calibration input touched."""
    h = 2 * xtx.double()  # [in, in]; the mean of x^T x over the calibration rows
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    h += damp * torch.diag(h).mean() * torch.eye(in_features, dtype=h.dtype, device=h.device)
    hinv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(hinv, upper=True).float(), dead


def gptq_quantize(weight: torch.Tensor, xtx: torch.Tensor, group: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] and X^T X / n [in, in] of its calibration inputs -> (packed q, scale, zero)
    as quantize_rtn_4bit."""
    out, in_features = weight.shape
    check_group(in_features, group)
    cpu = torch.device("cpu")  # a sequential sweep of small ops: the CPU, wherever the model lives
    w = weight.detach().float().to(cpu)
    xtx = xtx.to(cpu)
    column_weight = torch.diagonal(xtx).float()  # the inputs' mean square per column
    groups = in_features // group
    scale, zero = group_params(w.reshape(out, groups, group), column_weight.reshape(groups, group))
    order = torch.argsort(column_weight, descending=True, stable=True)  # act-order
    w = w[:, order]  # a copy: the sweep updates it in place
    hinv, dead = _inverse_hessian(xtx[order][:, order], in_features)
    w[:, dead] = 0
    q = torch.zeros(out, in_features, dtype=torch.uint8, device=cpu)
    for b0 in range(0, in_features, BLOCK):
        b1 = min(b0 + BLOCK, in_features)
        wb, hb = w[:, b0:b1], hinv[b0:b1, b0:b1]  # a view: updates land in w
        err = torch.zeros(out, b1 - b0, device=cpu)
        for i in range(b1 - b0):
            col = int(order[b0 + i])  # the weight column this is
            s, z = scale[:, col // group].float(), zero[:, col // group].float()
            qc = torch.round((wb[:, i] - z) / s).clamp_(0, 15)
            q[:, col] = qc.to(torch.uint8)
            e = (wb[:, i] - (qc * s + z)) / hb[i, i]
            wb[:, i:] -= e[:, None] * hb[i, i:][None, :]
            err[:, i] = e
        w[:, b1:] -= err @ hinv[b0:b1, b1:]
    dev = weight.device
    return pack_nibbles(q).to(dev), scale.contiguous().to(dev), zero.contiguous().to(dev)
