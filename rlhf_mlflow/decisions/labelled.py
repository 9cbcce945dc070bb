"""Certification from expert labels on the policy's own samples: prediction-powered inference (PPI++,
Angelopoulos et al. 2023) with the calibrated reward model as the predictor.

For one family, with the predictor f (the corrected reward model calibrated to the expert set),
N unlabelled samples of the policy (f_u) and n labelled ones (f_l, labels y):

    theta = lam * mean(f_u) + mean(y - lam * f_l)

is unbiased for the policy's mean true quality for any fixed lam (the labels remove the predictor's
bias); lam = cov(y, f_l) / ((1 + n/N) var(f)) (clipped to [0, 1]) minimises its variance, so the
interval shrinks with how well the reward model predicts the labels and is never wider than the
labels' own mean's (lam = 0). The variance is lam^2 var(f_u)/N + var(y - lam f_l)/n; the interval
uses Student's t with n - 1 degrees of freedom.

Labels requested in rounds are looked at after every round: a union bound over the `looks` allowed
keeps every look's interval valid together (each at level 1 - (1 - level) / looks).
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

MIN_LABELS = 20
"""A family is certifiable from policy labels alone with at least this many: below it the t interval
of a fraction-of-8 quality is too rough to decide a 0.03 guardrail, and the tuned weight too noisy."""


@dataclass(frozen=True)
class PPI:
    estimate: float
    se: float
    lam: float
    """The predictor's weight (0: the labels' own mean; 1: plain PPI)."""
    n: int
    """Labels."""
    N: int
    """Unlabelled policy samples."""


def ppi_mean(f_unlabelled: np.ndarray, f_labelled: np.ndarray, labels: np.ndarray) -> PPI:
    """The PPI++ estimate of E[y] under the policy, with its standard error."""
    fu, fl, y = (np.asarray(a, dtype=float) for a in (f_unlabelled, f_labelled, labels))
    n, N = len(y), len(fu)
    if n < 2:
        raise ValueError(f"PPI needs at least 2 labels, got {n}")
    var_f = np.var(np.concatenate([fu, fl]), ddof=1)
    lam = 0.0 if var_f <= 1e-12 else float(np.clip(np.cov(y, fl, ddof=1)[0, 1] / ((1 + n / N) * var_f), 0.0, 1.0))
    theta = lam * fu.mean() + (y - lam * fl).mean()
    se = float(np.sqrt(lam ** 2 * np.var(fu, ddof=1) / N + np.var(y - lam * fl, ddof=1) / n))
    return PPI(float(theta), se, lam, n, N)


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile by the Cornish-Fisher expansion around the normal one (Abramowitz & Stegun
    26.7.5): within 1e-3 of the exact value for df >= 10, conservative-side rough below."""
    z = NormalDist().inv_cdf(p)
    g1 = (z ** 3 + z) / 4
    g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
    g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
    g4 = (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160
    return z + g1 / df + g2 / df ** 2 + g3 / df ** 3 + g4 / df ** 4


def half_width(se: float, n: int, level: float, looks: int = 1) -> float:
    """Half the width of the two-sided interval at `level`, union-bounded over `looks`."""
    alpha = (1.0 - level) / max(looks, 1)
    return float(t_quantile(1.0 - alpha / 2.0, max(n - 1, 1)) * se)


def interval_draws(est: PPI, level: float, looks: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """Normal draws whose central `level` interval is this estimate's (union-bounded) interval: how a
    labelled family enters a bootstrapped aggregate beside off-policy families."""
    z = NormalDist().inv_cdf(0.5 + level / 2.0)
    return est.estimate + rng.standard_normal(size) * half_width(est.se, est.n, level, looks) / z


def with_policy_labels(row: dict, f_unlabelled: np.ndarray, f_labelled: np.ndarray, labels: np.ndarray,
                       reference_labels: np.ndarray, level: float, looks: int, min_labels: int, n_boot: int,
                       rng: np.random.Generator) -> tuple[dict, np.ndarray | None]:
    """A family's certify row redone with policy labels: the PPI estimate, its (union-bounded) interval
    and gain, and draws for the aggregates; the off-policy row is kept under `off_policy`. With fewer
    than `min_labels` labels the off-policy row stands and says how many labels it has (draws None)."""
    n = len(labels)
    off = {k: row.get(k) for k in ("certifiable", "reason", "estimate", "lo", "hi", "gain", "gain_lo", "gain_hi",
                                   "method")}
    out = {**row, "labels": n, "off_policy": off}
    if n < min_labels:
        out["reason"] = f"{row['reason']}; {n} policy labels < {min_labels} needed to certify from labels"
        out["evidence"] = "expert set (off-policy)" if row["certifiable"] else "none"
        return out, None
    est = ppi_mean(f_unlabelled, f_labelled, labels)
    hw = half_width(est.se, n, level, looks)
    ref_var = np.var(reference_labels, ddof=1) / len(reference_labels)
    gain_hw = half_width(float(np.sqrt(est.se ** 2 + ref_var)), n, level, looks)
    gain = est.estimate - row["reference"]
    out.update(certifiable=True, reason="ok", method="ppi", evidence=f"policy labels ({n})", estimate=est.estimate,
               lo=est.estimate - hw, hi=est.estimate + hw, gain=gain, gain_lo=gain - gain_hw, gain_hi=gain + gain_hw,
               ppi={"lambda": est.lam, "se": est.se, "unlabelled": est.N, "looks": looks})
    return out, interval_draws(est, level, looks, n_boot, rng)
