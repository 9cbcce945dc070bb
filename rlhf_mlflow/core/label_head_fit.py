"""Fitting the label head (core/label_head.py) to expert labels.

Per family, L1-regularised least squares over the head's indicators (the lasso, with an unpenalised
intercept), solved for every family and fold at once by FISTA: the problem is separable by block, and
each row touches 32 indicators, so a step is a gather and a scatter. Then, per family, the trunk's and
the head's out-of-fold scores are stacked: y ~ a * trunk + c * head + b by least squares (a and c kept
>= 0), so the head counts as much as it predicts labels it did not see, and the trunk keeps its weight
where the labels are too few to say more. The stacked out-of-fold scores are the repaired model's
cross-validated scores (the gate's agreement; the two stacking weights per family are fitted on them,
a small optimism with hundreds of labels per family). `cross_fitted_heads`: one head per fold, fitted
without it, for certify's cross-fitted predictor (decisions/cross_fit.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_mlflow.core import label_head as LH
from rlhf_mlflow.core import vocab as V

ALPHA = 1e-4
"""The L1 weight (per row-averaged squared error; scikit-learn's Lasso convention). Chosen on the default
world (90873596517cfb63) between 5e-5 and 5e-4: the labels' fit barely moves across that range, and
more shrinkage lowered the truth an RL run reached (docs/REPAIR.md)."""


@dataclass
class Blocks:
    """A separable lasso: rows, each in one block (a family, or a family without a fold), each block
    with its own PER_FAMILY coefficients and intercept."""
    flat: torch.Tensor   # (N, k) indicator indices within the row's block (-1: none)
    block: torch.Tensor  # (N,) block of each row
    y: torch.Tensor      # (N,)
    n_blocks: int

    def predict(self, w: torch.Tensor, b: torch.Tensor, flat: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        return b[block] + LH.indicator_sum(w.reshape(-1), LH.in_block(flat, block))


def lasso(p: Blocks, alpha: float = ALPHA, iters: int = 5000, tol: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """FISTA with adaptive restart on every block at once: per block, minimise
    1/(2 n) ||y - b - X w||^2 + alpha ||w||_1. Stops when no coefficient moves by more than `tol`.
    Returns (w (n_blocks, PER_FAMILY), b (n_blocks,)); an indicator no row has stays 0."""
    B, K = p.n_blocks, LH.PER_FAMILY
    n = torch.bincount(p.block, minlength=B).clamp(min=1).to(torch.float64)
    g = LH.in_block(p.flat, p.block)
    seen, col = torch.unique(g[g >= 0], return_inverse=True)
    U = len(seen)
    cols = torch.full_like(g, U)                  # the indicators each row has, in the seen ones; U: none
    cols[g >= 0] = col
    rows_w = (1.0 / n)[p.block]                   # each row's share of its block's mean

    def xt(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:        # [X 1]^T r, all blocks
        gw = torch.zeros(U + 1, dtype=torch.float64).index_add_(0, cols.reshape(-1), r.repeat_interleave(cols.shape[1]))
        gw[U] = 0.0
        return gw, torch.zeros(B, dtype=torch.float64).index_add_(0, p.block, r)

    def xw(w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return b[p.block] + w[cols].sum(1)

    step = 1.0 / (_lipschitz(U + 1, B, xt, xw, rows_w) * 1.05)
    y = p.y.to(torch.float64)
    w, b = torch.zeros(U + 1, dtype=torch.float64), torch.zeros(B, dtype=torch.float64)
    zw, zb, t = w.clone(), b.clone(), 1.0
    for _ in range(iters):
        gw, gb = xt((xw(zw, zb) - y) * rows_w)
        w_new, b_new = _soft(zw - step * gw, step * alpha), zb - step * gb
        if float(((zw - w_new) * (w_new - w)).sum() + ((zb - b_new) * (b_new - b)).sum()) > 0:
            t = 1.0  # momentum points uphill: restart it (O'Donoghue & Candes 2015)
        t_new = (1 + (1 + 4 * t * t) ** 0.5) / 2
        zw = w_new + (t - 1) / t_new * (w_new - w)
        zb = b_new + (t - 1) / t_new * (b_new - b)
        moved = max(float((w_new - w).abs().max()), float((b_new - b).abs().max()))
        w, b, t = w_new, b_new, t_new
        if moved < tol:
            break
    full = torch.zeros(B * K, dtype=torch.float64)
    full[seen] = w[:U]
    return full.reshape(B, K).float(), b.float()


def _soft(x: torch.Tensor, thr: float) -> torch.Tensor:
    return torch.sign(x) * (x.abs() - thr).clamp(min=0)


def _lipschitz(n_cols: int, n_blocks: int, xt, xw, rows_w: torch.Tensor, iters: int = 30) -> float:
    """The largest eigenvalue of the (row-weighted) [X 1]^T [X 1], by power iteration."""
    gen = torch.Generator().manual_seed(0)
    w = torch.rand(n_cols, generator=gen, dtype=torch.float64)
    b = torch.rand(n_blocks, generator=gen, dtype=torch.float64)
    lam = 1.0
    for _ in range(iters):
        w2, b2 = xt(xw(w, b) * rows_w)
        norm = float(torch.sqrt((w2 ** 2).sum() + (b2 ** 2).sum()))
        lam = norm / float(torch.sqrt((w ** 2).sum() + (b ** 2).sum()))
        if norm == 0:
            break
        w, b = w2 / norm, b2 / norm
    return max(lam, 1e-12)


def stack(y: torch.Tensor, trunk: torch.Tensor, head: torch.Tensor) -> tuple[float, float, float]:
    """(a, c, b) of y ~ a * trunk + c * head + b by least squares, a and c kept >= 0 (a column whose
    weight comes out negative is dropped and the rest refitted)."""
    cols = {"a": trunk.double(), "c": head.double()}
    while True:
        names = list(cols)
        x = torch.stack([cols[k] for k in names] + [torch.ones_like(y, dtype=torch.float64)], 1)
        sol = torch.linalg.lstsq(x, y.double()[:, None]).solution.squeeze(1)
        neg = [k for k, v in zip(names, sol[:-1].tolist()) if v < 0]
        if not neg:
            out = dict(zip(names, sol[:-1].tolist()))
            return out.get("a", 0.0), out.get("c", 0.0), float(sol[-1])
        del cols[min(neg, key=lambda k: dict(zip(names, sol.tolist()))[k])]


@dataclass
class HeadFit:
    head: LH.LabelHead
    oof: torch.Tensor  # (N,) the stacked out-of-fold score of each row
    report: dict       # per family: trunk and head weights, indicators used


def fit_head(ids: torch.Tensor, y: torch.Tensor, trunk_oof: torch.Tensor, folds: torch.Tensor,
             alpha: float = ALPHA) -> HeadFit:
    """The label head for expert-labelled rows ([prompt ; response] ids (N, T), labels (N,)), given the
    trunk's out-of-fold scores (the fold's fine-tune never saw the row; the stacking weights found on
    them apply to the full fine-tune's trunk), with rows split by `folds` (N,) in 0..k-1."""
    fam, flat = LH.indicator_index(ids)
    F, n_folds = len(V.FAMILIES), int(folds.max()) + 1
    w, b, head_oof = _fold_fits(fam, flat, y, folds, alpha)
    head, oof, report = _stacked(fam, y, trunk_oof, head_oof, w[n_folds * F:], b[n_folds * F:])
    return HeadFit(head, oof, report)


def cross_fitted_heads(ids: torch.Tensor, y: torch.Tensor, trunk: torch.Tensor, folds: torch.Tensor,
                       alpha: float = ALPHA) -> list[LH.LabelHead]:
    """One head per fold k of `folds` (N,) in 0..k-1, for predicting fold k's rows, fitted on the other
    folds' rows alone: per family the trunk's scores (N,) calibrated by least squares, and the lasso of
    what the calibrated trunk leaves (its residuals). No label of fold k enters fold k's head (stacking by
    out-of-fold scores, as fit_head does, would let them in through the other folds' heads)."""
    fam, flat = LH.indicator_index(ids)
    F = len(V.FAMILIES)
    rows, blocks = _without_each_fold(fam, folds)
    calib = [_calibration(y[keep], trunk[keep], fam[keep], F) for keep in rows]
    target = [y[keep] - a[fam[keep]] * trunk[keep] - b[fam[keep]] for keep, (a, b) in zip(rows, calib)]
    r, blk = torch.cat(rows), torch.cat(blocks)
    w, b = lasso(Blocks(flat[r], blk, torch.cat(target).float(), len(rows) * F), alpha)
    return [LH.LabelHead(w[k * F:(k + 1) * F].reshape(LH.SHAPE), a_k, b[k * F:(k + 1) * F] + b_k)
            for k, (a_k, b_k) in enumerate(calib)]


def _without_each_fold(fam: torch.Tensor, folds: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per fold k of `folds` (0..k-1), the rows outside it and their lasso block (fold k, family): k * F + family."""
    F = len(V.FAMILIES)
    rows = [(folds != k).nonzero().flatten() for k in range(int(folds.max()) + 1)]
    return rows, [fam[keep] + k * F for k, keep in enumerate(rows)]


def _calibration(y: torch.Tensor, trunk: torch.Tensor, fam: torch.Tensor, F: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per family, (slope, intercept) of y ~ trunk by least squares (slope 0 where the trunk is constant): the
    torch form of decisions/ope_math.linear_calibration, which core cannot import."""
    a, b = torch.zeros(F), torch.zeros(F)
    for f in range(F):
        m = fam == f
        if not bool(m.any()):
            continue
        t, v = trunk[m].double(), y[m].double()
        var = float(((t - t.mean()) ** 2).mean())
        a[f] = 0.0 if var <= 1e-12 else float(((t - t.mean()) * (v - v.mean())).mean()) / var
        b[f] = float(v.mean()) - float(a[f]) * float(t.mean())
    return a, b


def _fold_fits(fam: torch.Tensor, flat: torch.Tensor, y: torch.Tensor, folds: torch.Tensor,
               alpha: float = ALPHA) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The lasso of every (fold k, family) block on the rows outside fold k and of every family on all its
    rows (blocks after the folds'), in one FISTA; with each row's out-of-fold score."""
    F, n_folds = len(V.FAMILIES), int(folds.max()) + 1
    rows, blocks = _without_each_fold(fam, folds)
    rows.append(torch.arange(len(y)))
    blocks.append(fam + n_folds * F)
    r, blk = torch.cat(rows), torch.cat(blocks)
    w, b = lasso(Blocks(flat[r], blk, y[r].float(), (n_folds + 1) * F), alpha)
    prob = Blocks(flat, fam, y, F)
    head_oof = torch.zeros(len(y))
    for k in range(n_folds):
        held = folds == k
        head_oof[held] = prob.predict(w[k * F:(k + 1) * F], b[k * F:(k + 1) * F], flat[held], fam[held])
    return w, b, head_oof


def _stacked(fam: torch.Tensor, y: torch.Tensor, trunk: torch.Tensor, head_oof: torch.Tensor,
             w: torch.Tensor, b: torch.Tensor) -> tuple[LH.LabelHead, torch.Tensor, dict]:
    """The head of lasso coefficients (w (F, PER_FAMILY), b (F,)) stacked on the trunk per family:
    y ~ a * trunk + c * head_oof + b0; with the rows' stacked scores and the weights per family. A family
    with fewer than 4 rows keeps the trunk alone."""
    F = len(V.FAMILIES)
    coef, neural, bias = torch.zeros(F, LH.PER_FAMILY), torch.zeros(F), torch.zeros(F)
    oof, report = torch.zeros(len(y)), {}
    for f in range(F):
        m = fam == f
        if int(m.sum()) < 4:  # too few labels to say anything: the trunk alone
            neural[f] = 1.0
            oof[m] = trunk[m]
            continue
        a, c, b0 = stack(y[m], trunk[m], head_oof[m])
        coef[f], neural[f], bias[f] = c * w[f], a, b0 + c * float(b[f])
        oof[m] = a * trunk[m] + c * head_oof[m] + b0
        report[V.FAMILIES[f]] = {"trunk_weight": round(a, 4), "head_weight": round(c, 4),
                                 "indicators": int((w[f] != 0).sum()), "labels": int(m.sum())}
    return LH.LabelHead(coef.reshape(LH.SHAPE), neural, bias), oof, report
