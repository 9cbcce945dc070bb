"""The label head's solver: the lasso over many independent blocks at once (FISTA), and the adaptive
group lasso the repair's head is fitted by (core/label_head_fit.py says what is fitted on which rows).

A block is a family, or a family without one cross-validation fold; every row touches 32 indicators of
its block (core/label_head.py), so a step is a gather and a scatter over all blocks together.
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
        own, theirs = (torch.ones(len(q.y)) if q.weight is None else q.weight.float() for q in (p, guide))
        p = Blocks(torch.cat([p.flat, guide.flat]), torch.cat([p.block, guide.block]),
                   torch.cat([p.y, guide.y.to(p.y.dtype)]), p.n_blocks, torch.cat([own, theirs]))
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
