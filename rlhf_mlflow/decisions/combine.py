"""One family estimate from both kinds of evidence: the expert set reweighted to the policy (off-policy,
doubly robust) and expert labels on the policy's own samples (PPI), weighted by their variances and
covariance.

Both are unbiased for the same quantity, the policy's mean true quality on the family's prompts, and
both start from the same term, the calibrated reward model's mean over the policy's own samples on the
P expert prompts (lam times it, lam PPI's tuned weight); they differ in how they remove its bias:

    off-policy:  R_dr = sum_i w_i (y_i - lam f(x_i, y_i)) / sum_i w_i   over the expert rows (weights pi / pi_ref)
    labels:      R_l  = mean_j (y_j - lam f(x_j, y_j))                   over the policy's labelled samples

    theta = lam mean_p m_p + alpha R_l + (1 - alpha) R_dr

Every piece is indexed by the expert prompts (expert row i is prompt i, the unlabelled samples' row p is
prompt p, label j was drawn on prompt at_j), so theta - E theta is, to first order, the mean over prompts of
one influence term per prompt,

    c_p = lam m_p + alpha (P / n) sum_{j: at_j = p} (r_j - R_l) + (1 - alpha) k P w_p (e_p - R_dr) / sum w,

and var(theta) = var(c_p) / P carries every covariance (shared prompts, the shared reward model term).
k is the off-policy widening (ope_math.small_sample_widening): the expert rows' part enters with the
spread certify allows it, not the bootstrap's. alpha minimises var(c_p) over [0, 1]. A family the expert
set cannot vouch for (certify's overlap rule) gets alpha = 1: labels alone, as before.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Combined:
    estimate: float
    se: float
    alpha: float
    """The labels' weight in the correction (1: labels alone; 0: the expert set alone)."""
    unlabelled_terms: np.ndarray
    """Per prompt, lam m_p (for the skewness correction)."""
    influence: np.ndarray
    """c_p per prompt (for the gain's standard error)."""


def influence_terms(a: np.ndarray, residuals: np.ndarray, at: np.ndarray, dr_residuals: np.ndarray,
                    log_ratios: np.ndarray, widening: float) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Per prompt, the labels' and the expert rows' centred influence (x_p, y_p), and R_l, R_dr."""
    P, n = len(a), len(residuals)
    w = np.exp(log_ratios - log_ratios.max())
    w = w / w.sum()
    r_dr = float(np.sum(w * dr_residuals))
    y_p = widening * P * w * (dr_residuals - r_dr)
    r_l = float(residuals.mean())
    x_p = np.zeros(P)
    np.add.at(x_p, at, P / n * (residuals - r_l))
    return x_p, y_p, r_l, r_dr


def combine(a: np.ndarray, residuals: np.ndarray, at: np.ndarray, dr_residuals: np.ndarray,
            log_ratios: np.ndarray, widening: float) -> Combined:
    """theta and its standard error from per-prompt unlabelled terms `a` (lam m_p, P of them), label
    residuals y - lam f at prompts `at` (all >= 0), and the expert rows' residuals y - lam f with their
    log importance ratios (one per prompt, in the same order)."""
    a, residuals, dr_residuals, log_ratios = (np.asarray(v, float) for v in (a, residuals, dr_residuals, log_ratios))
    at = np.asarray(at, int)
    P = len(a)
    if len(dr_residuals) != P or len(log_ratios) != P or at.min(initial=0) < 0 or at.max(initial=0) >= P:
        raise ValueError("combine needs one expert row per unlabelled prompt and every label on one of them")
    x_p, y_p, r_l, r_dr = influence_terms(a, residuals, at, dr_residuals, log_ratios, widening)
    base, diff = (a - a.mean()) + y_p, x_p - y_p
    v_diff = float(np.var(diff, ddof=1))
    alpha = 1.0 if v_diff <= 1e-15 else float(np.clip(-np.cov(base, diff, ddof=1)[0, 1] / v_diff, 0.0, 1.0))
    c = a + y_p + alpha * diff
    est = float(a.mean() + alpha * r_l + (1 - alpha) * r_dr)
    return Combined(est, float(np.sqrt(np.var(c, ddof=1) / P)), alpha, a, c)
