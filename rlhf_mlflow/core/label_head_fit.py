"""Fitting the label head (core/label_head.py) to expert labels.

Per family, L1-regularised least squares over the head's indicators (the lasso, with an unpenalised
intercept), solved for every family and fold at once (core/lasso.py). The repair's head is an adaptive
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
from rlhf_mlflow.core.lasso import ALPHA, FITS, Blocks, adaptive_lasso, lasso

__all__ = ["ALPHA", "FITS", "GUIDE_WEIGHT", "Blocks", "Guide", "HeadFit", "adaptive_lasso", "cross_fitted_heads",
           "fit_head", "lasso", "stack"]

GUIDE_WEIGHT = 0.11
"""A guide row's weight against an expert label's: (0.03 / 0.09)^2, the expert and crowd label noise the
seed's world documents, and the better of 0.11 and 0.3 by the proxy on the default world (docs/REPAIR.md)."""


@dataclass
class Guide:
    """Rows labelled more noisily than the expert labels (repair_rm passes the crowd's QA sample with its
    flagged premiums taken out) that join the adaptive fit's two lassos at a weight per row: they say
    which (position, attribute) groups matter and, a little, what their tokens are worth; the expert labels
    alone decide the stacking and the agreement (the head's out-of-fold scores are the expert rows')."""
    ids: torch.Tensor  # (N, T) [prompt ; response]
    y: torch.Tensor    # (N,)
    weight: float = GUIDE_WEIGHT


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
