"""Fitting the label head (core/label_head.py) to expert labels.

Per family, L1-regularised least squares over the head's indicators (the lasso, with an unpenalised
intercept), solved for every family and fold at once by FISTA: the problem is separable by block, and
each row touches 32 indicators, so a step is a gather and a scatter. The repair's head is an adaptive
group lasso (`adaptive_lasso`: a second lasso weighted by the first's (position, attribute) group norms)
with the crowd's QA sample as a low-weight `Guide`, kept per family only where it predicts the expert
labels better out of fold (`fit_head`; docs/REPAIR.md). Then, per family, the trunk's and
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

ADAPTIVE_ALPHA = 3e-5
"""The second stage's L1 weight (`adaptive_lasso`), before each indicator's group factor."""
ADAPTIVE_FLOOR = 0.05
"""An indicator's group factor is 1 / (g + ADAPTIVE_FLOOR), g its (position, attribute) group's first-stage
norm over the block's largest: a group the first stage left empty is penalised 1 / 0.05 = 20 times the
L1 weight, the strongest ~1 time. ADAPTIVE_ALPHA and the floor were chosen on the default world
(90873596517cfb63) by a proxy (the truth of the reference policy tilted by the head's score, 25-100 labels
per family: flat for floors 0.01-0.2 and weights 1e-5-5e-5) and checked by RL there and on worlds not
looked at before (docs/REPAIR.md)."""
GUIDE_WEIGHT = 0.11
"""A guide row's weight against an expert label's: (0.03 / 0.09)^2, the expert and crowd label noise the
seed's world documents, and the better of 0.11 and 0.3 by the proxy on the default world (docs/REPAIR.md)."""
FITS = ("adaptive", "lasso")
"""How the head is fitted: the adaptive group lasso (default) or one lasso at ALPHA."""


@dataclass
class Blocks:
    """A separable lasso: rows, each in one block (a family, or a family without a fold), each block
    with its own PER_FAMILY coefficients and intercept."""
    flat: torch.Tensor   # (N, k) indicator indices within the row's block (-1: none)
    block: torch.Tensor  # (N,) block of each row
    y: torch.Tensor      # (N,)
    n_blocks: int
    weight: torch.Tensor | None = None
    """(N,) each row's weight in its block's mean squared error (None: equal)."""

    def predict(self, w: torch.Tensor, b: torch.Tensor, flat: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        return b[block] + LH.indicator_sum(w.reshape(-1), LH.in_block(flat, block))


def lasso(p: Blocks, alpha: float | torch.Tensor = ALPHA, iters: int = 5000, tol: float = 1e-6,
          start: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FISTA with adaptive restart on every block at once: per block, minimise
    1/(2 n) ||y - b - X w||^2 + sum_j alpha_j |w_j|, `alpha` one weight for every indicator or one per
    indicator (n_blocks, PER_FAMILY). Stops when no coefficient moves by more than `tol`. `start`: (w, b)
    of a nearby problem to begin from (a warm start: the same minimum, fewer steps).
    Returns (w (n_blocks, PER_FAMILY), b (n_blocks,)); an indicator no row has stays 0."""
    B, K = p.n_blocks, LH.PER_FAMILY
    rw = torch.ones(len(p.y), dtype=torch.float64) if p.weight is None else p.weight.to(torch.float64)
    n = torch.zeros(B, dtype=torch.float64).index_add_(0, p.block, rw).clamp(min=1e-12)
    g = LH.in_block(p.flat, p.block)
    seen, col = torch.unique(g[g >= 0], return_inverse=True)
    U = len(seen)
    cols = torch.full_like(g, U)                  # the indicators each row has, in the seen ones; U: none
    cols[g >= 0] = col
    rows_w = rw / n[p.block]                      # each row's share of its block's mean
    if isinstance(alpha, torch.Tensor):
        alpha = torch.cat([alpha.reshape(-1).to(torch.float64)[seen], torch.zeros(1, dtype=torch.float64)])

    def xt(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:        # [X 1]^T r, all blocks
        gw = torch.zeros(U + 1, dtype=torch.float64).index_add_(0, cols.reshape(-1), r.repeat_interleave(cols.shape[1]))
        gw[U] = 0.0
        return gw, torch.zeros(B, dtype=torch.float64).index_add_(0, p.block, r)

    def xw(w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return b[p.block] + w[cols].sum(1)

    step = 1.0 / (_lipschitz(U + 1, B, xt, xw, rows_w) * 1.05)
    y = p.y.to(torch.float64)
    w, b = torch.zeros(U + 1, dtype=torch.float64), torch.zeros(B, dtype=torch.float64)
    if start is not None:
        w[:U] = start[0].reshape(-1).to(torch.float64)[seen]
        b = start[1].to(torch.float64).clone()
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


@dataclass
class Guide:
    """Rows labelled more noisily than the expert labels (repair_rm passes the crowd's QA sample with its
    flagged premiums taken out) that join the adaptive fit's two lassos at a weight per row: they say
    which (position, attribute) groups matter and, a little, what their tokens are worth; the expert labels
    alone decide the stacking and the agreement (the head's out-of-fold scores are the expert rows')."""
    ids: torch.Tensor  # (N, T) [prompt ; response]
    y: torch.Tensor    # (N,)
    weight: float = GUIDE_WEIGHT


def adaptive_lasso(p: Blocks, alpha: float = ALPHA, fit: str = "adaptive",
                   guide: Blocks | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's coefficients for every block: with fit="lasso" one lasso at `alpha` on `p` alone; with
    "adaptive" (an adaptive group lasso, after Zou 2006) that lasso ranks each block's (position,
    attribute) groups of indicators by their coefficients' norm, and a second lasso penalises each
    indicator by ADAPTIVE_ALPHA / (its group's norm over the block's largest + ADAPTIVE_FLOOR). What a
    position depends on is usually a few prompt attributes: the first fit finds them, and the second
    spends the labels on those groups' tokens instead of spreading them over every attribute's
    indicators. `guide`: noisier rows in the same blocks, with their weights, that join both fits."""
    if fit not in FITS:
        raise ValueError(f"label head fit {fit!r}: expected one of {', '.join(FITS)}")
    if fit == "lasso":
        return lasso(p, alpha)
    if guide is not None:
        own = torch.ones(len(p.y)) if p.weight is None else p.weight
        p = Blocks(torch.cat([p.flat, guide.flat]), torch.cat([p.block, guide.block]),
                   torch.cat([p.y, guide.y.to(p.y.dtype)]), p.n_blocks, torch.cat([own, guide.weight.float()]))
    first = lasso(p, alpha)
    w = first[0]
    shape = (p.n_blocks, V.RESP_LEN, V.N_CONTENT, V.N_ATTR, V.N_VAL)
    g = w.double().reshape(shape).pow(2).sum((2, 4)).sqrt()                        # (blocks, position, attribute)
    g = g / g.amax((1, 2), keepdim=True).clamp(min=1e-12)
    factor = (1.0 / (g + ADAPTIVE_FLOOR))[:, :, None, :, None].expand(shape)
    return lasso(p, ADAPTIVE_ALPHA * factor.reshape(p.n_blocks, -1), start=first)


def _soft(x: torch.Tensor, thr) -> torch.Tensor:
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
             alpha: float = ALPHA, fit: str = "adaptive", guide: Guide | None = None) -> HeadFit:
    """The label head for expert-labelled rows ([prompt ; response] ids (N, T), labels (N,)), given the
    trunk's out-of-fold scores (the fold's fine-tune never saw the row; the stacking weights found on
    them apply to the full fine-tune's trunk), with rows split by `folds` (N,) in 0..k-1. With a `guide`
    (adaptive fit), each family keeps the head with or without it, whichever predicts its expert labels
    out of fold better (Pearson r): a guide that does not agree with the experts is not used."""
    fam, flat = LH.indicator_index(ids)
    F, n_folds = len(V.FAMILIES), int(folds.max()) + 1
    w, b, head_oof = _fold_fits(fam, flat, y, folds, alpha, fit)
    guided = {}
    if guide is not None and fit == "adaptive" and len(guide.y):
        wg, bg, oof_g = _fold_fits(fam, flat, y, folds, alpha, fit, guide)
        for f in range(F):
            m = fam == f
            guided[V.FAMILIES[f]] = bool(m.sum() >= 4) and _r(oof_g[m], y[m]) > _r(head_oof[m], y[m])
            if guided[V.FAMILIES[f]]:
                blocks = torch.arange(n_folds + 1) * F + f
                w[blocks], b[blocks], head_oof[m] = wg[blocks], bg[blocks], oof_g[m]
    head, oof, report = _stacked(fam, y, trunk_oof, head_oof, w[n_folds * F:], b[n_folds * F:])
    for family, used in guided.items():
        if family in report:
            report[family]["guided"] = used
    return HeadFit(head, oof, report)


def _r(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson r of two vectors (0 where either is constant)."""
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    den = float(torch.sqrt((a * a).sum() * (b * b).sum()))
    return float((a * b).sum()) / den if den > 0 else 0.0


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
               alpha: float = ALPHA, fit: str = "adaptive",
               guide: Guide | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The lasso of every (fold k, family) block on the rows outside fold k and of every family on all its
    rows (blocks after the folds'), in one FISTA; with each row's out-of-fold score."""
    F, n_folds = len(V.FAMILIES), int(folds.max()) + 1
    rows, blocks = _without_each_fold(fam, folds)
    rows.append(torch.arange(len(y)))
    blocks.append(fam + n_folds * F)
    r, blk = torch.cat(rows), torch.cat(blocks)
    p = Blocks(flat[r], blk, y[r].float(), (n_folds + 1) * F)
    w, b = adaptive_lasso(p, alpha, fit, _guide_blocks(guide, n_folds + 1) if fit == "adaptive" else None)
    prob = Blocks(flat, fam, y, F)
    head_oof = torch.zeros(len(y))
    for k in range(n_folds):
        held = folds == k
        head_oof[held] = prob.predict(w[k * F:(k + 1) * F], b[k * F:(k + 1) * F], flat[held], fam[held])
    return w, b, head_oof


def _guide_blocks(guide: Guide | None, n_copies: int) -> Blocks | None:
    """The guide's rows in every copy of their family's block (copy c, family f: block c * F + f)."""
    if guide is None or len(guide.y) == 0:
        return None
    fam, flat = LH.indicator_index(guide.ids)
    F = len(V.FAMILIES)
    blocks = torch.cat([fam + c * F for c in range(n_copies)])
    return Blocks(flat.repeat(n_copies, 1), blocks, guide.y.float().repeat(n_copies), n_copies * F,
                  torch.full((n_copies * len(guide.y),), guide.weight))


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
