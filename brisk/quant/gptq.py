"""GPTQ rounding for int4 groups (Frantar et al., 2022), from the calibration activations.

Round-to-nearest rounds every weight on its own. GPTQ rounds the columns of W one at a time and
spreads each column's rounding error over the columns not yet rounded, weighted by the inverse
Hessian of the layer's squared output error, H = 2 X^T X / n: the error that a later column can
cancel, it cancels. Columns go in act-order, the largest inputs first (while the most columns are
left to absorb their error), and every group's scale and offset are fixed beforehand from the
unchanged weights ("static groups", so act-order needs no regrouping) by the clipping search of
`group_params`, weighted by each column's mean square input. On the default model at g64 (8,192
WikiText tokens) this took the KL to float32 from 0.086 (weights' own order, grids fitted as the
sweep entered each group) to 0.068. After the sweep each row's scales and offsets are fitted
again to its integers by least squares under the same Hessian (`refit_groups`): the grid chosen
before rounding is not the best one for the integers GPTQ chose (measured below). The output is GroupLinear's format (4-bit, float16 scale and
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
    w0 = weight.detach().float().to(cpu)  # read only (it may be `weight` itself)
    xtx = xtx.to(cpu)
    column_weight = torch.diagonal(xtx).float()  # the inputs' mean square per column
    groups = in_features // group
    scale, zero = group_params(w0.reshape(out, groups, group), column_weight.reshape(groups, group))
    order = torch.argsort(column_weight, descending=True, stable=True)  # act-order
    w = w0[:, order]  # a copy: the sweep updates it in place, w0 stays for the refit
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
    scale, zero = refit_groups(w0, xtx, q, scale, zero, group)
    dev = weight.device
    return pack_nibbles(q).to(dev), scale.contiguous().to(dev), zero.contiguous().to(dev)


REFIT_ELEMENTS = 1 << 24  # floats of a row chunk's H q products (64 MiB): rows per chunk follow from it
RIDGE = 1e-3  # fraction of H's mean diagonal added for the solve: a group no input reaches stays defined


def refit_groups(w: torch.Tensor, xtx: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the float16 scales and offsets that, with the integers q [out, in] kept, minimise
    the output error (w - w_hat) H (w - w_hat)^T, w_hat = q * s_g + z_g: a linear least-squares
    problem of 2 * groups unknowns a row, solved exactly. A row keeps `scale` / `zero` where the
    refit (after its float16 rounding) is not better. On the default model at g64 it took
    perplexity from +8.44% to +8.08% (WikiText) and +6.42% to +5.71% (code) with the model's own
    text as calibration, and +5.53% / +7.25% to +5.48% / +6.76% with WikiText's."""
    out, n = q.shape
    groups = n // group
    h = xtx.float() + RIDGE * torch.diagonal(xtx).float().mean() * torch.eye(n)
    h_sum = h.reshape(n, groups, group).sum(dim=-1)  # [in, groups]: H's columns summed per group
    a_zz = h_sum.reshape(groups, group, groups).sum(dim=1)  # [groups, groups]
    new_scale, new_zero = scale.clone(), zero.clone()
    rows = max(1, REFIT_ELEMENTS // (n * groups))
    for r0 in range(0, out, rows):
        r1 = min(out, r0 + rows)
        qc, wc = q[r0:r1].float(), w[r0:r1]
        # H q per group of columns: hq[r, i, g] = sum over j in group g of H[i, j] q[r, j]
        hq = torch.einsum("ngj,rgj->rng", h.reshape(n, groups, group), qc.reshape(-1, groups, group))
        qg = qc.reshape(-1, groups, group)
        a_ss = torch.einsum("rgi,rgih->rgh", qg, hq.reshape(-1, groups, group, groups))
        a_sz = torch.einsum("rgi,gih->rgh", qg, h_sum.reshape(groups, group, groups))
        a = torch.cat([torch.cat([a_ss, a_sz], dim=2),
                       torch.cat([a_sz.transpose(1, 2), a_zz.expand(r1 - r0, -1, -1)], dim=2)], dim=1).double()
        wh = (wc @ h).reshape(-1, groups, group)
        b = torch.cat([(qg * wh).sum(-1), wh.sum(-1)], dim=1).double()
        theta, info = torch.linalg.solve_ex(a, b)
        s_new, z_new = theta[:, :groups].half(), theta[:, groups:].half()
        ok = (info == 0) & torch.isfinite(s_new.float()).all(dim=1) & torch.isfinite(z_new.float()).all(dim=1)
        before = _row_error(wc, h, qg, scale[r0:r1], zero[r0:r1])
        after = _row_error(wc, h, qg, s_new, z_new)
        better = ok & (after < before)
        new_scale[r0:r1] = torch.where(better[:, None], s_new, scale[r0:r1])
        new_zero[r0:r1] = torch.where(better[:, None], z_new, zero[r0:r1])
    return new_scale, new_zero


def _row_error(w: torch.Tensor, h: torch.Tensor, qg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
               ) -> torch.Tensor:
    """(w - w_hat) H (w - w_hat)^T per row, w_hat from float16 scale and zero (NaN-safe: inf)."""
    w_hat = (qg * scale.float()[..., None] + zero.float()[..., None]).reshape(w.shape)
    d = w - w_hat
    err = ((d @ h) * d).sum(dim=1)
    return torch.where(torch.isfinite(err), err, torch.full_like(err, float("inf")))
