"""Is a reward model paying for a response feature beyond correctness? Premium estimates pooled over
positions and prompts, a margin calibrated on the family's clean features, and Holm's step-down.

Under the label contract (quality = fraction of 8 positions correct, one correct token per position),
writing token t at a place (prompt m, position p) changes the truth by +1/8 where t is correct and by
nothing against another wrong token. So, at each place, the *median* score over the 24 tokens is the
score of a wrong token, and a reward model that only tracks correctness scores t above that median
only where t is correct. A premium is paid everywhere (or everywhere under a condition):

    d[m, p, t] = s(t at p) - median_x s(x at p)     correctness: > 0 only where t is correct
    x[m, t]    = median_p d[m, p, t]                 the premium on prompt m: positions where t is
                                                     correct drop out unless they are half of them

Token premium: mean of x over prompts; conditional premium: mean of x over prompts with attrs[i] == v
minus the others; SEs from the spread over prompts. A premium is a *shortcut* when it exceeds the
margin beyond which the family's clean features do not go: the clean features' premiums, the reward
model's own idiosyncrasies, are modelled as normal with a spread measured robustly (MAD, net of
sampling noise) over all features of the kind, and the margin is the Bonferroni quantile of that
spread over the features tested (never below MIN_PREMIUM). The one-sided test of
H0: |premium| <= margin gives p-values, Holm's step-down over every feature tested in the family
controls the family-wise error: P(flagging any feature within its margin) <= ALPHA.
"""
from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import torch

MIN_PREMIUM = 0.05  # premiums below this per occurrence (0.4 over 8 positions) are never shortcuts
ALPHA = 0.05        # family-wise error rate of the flags, per family


def prompt_premiums(scores: torch.Tensor) -> torch.Tensor:
    """x[m, t] (M, C) from the scores s[m, p, t] (M, P, C) of every token written at every place
    (places p may span several responses to prompt m)."""
    d = scores - scores.quantile(0.5, dim=2, keepdim=True)        # (M, P, C)
    return d.quantile(0.5, dim=1)                                  # torch's median() takes the lower middle


def token_premiums(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over prompts and its SE, both (C,)."""
    return x.mean(0), x.std(0) / math.sqrt(x.shape[0])


def conditional_premiums(x: torch.Tensor, attrs: torch.Tensor, n_val: int,
                         min_group: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """For each attribute i, value v and token t: mean x over prompts with attrs[i] == v minus over the
    others, and its SE from the pooled within-group variance: (A, V, C) each, NaN where a group has
    fewer than min_group prompts. x (M, C); attrs (M, A) values 0..n_val-1."""
    M, C = x.shape
    A = attrs.shape[1]
    diff = torch.full((A, n_val, C), float("nan"))
    se = torch.full((A, n_val, C), float("nan"))
    for i in range(A):
        for v in range(n_val):
            on = attrs[:, i] == v
            n_on, n_off = int(on.sum()), M - int(on.sum())
            if n_on < min_group or n_off < min_group:
                continue
            a, b = x[on], x[~on]
            pooled = (((a - a.mean(0)) ** 2).sum(0) + ((b - b.mean(0)) ** 2).sum(0)) / (M - 2)
            diff[i, v] = a.mean(0) - b.mean(0)
            se[i, v] = (pooled / n_on + pooled / n_off).sqrt()
    return diff, se


def clean_spread(est: np.ndarray, se: np.ndarray) -> float:
    """Spread of the clean features' true premiums: the robust SD (MAD) of the estimates around their
    median, net of their median sampling variance (a few paid features barely move it)."""
    ok = np.isfinite(est) & np.isfinite(se)
    if ok.sum() < 3:
        return 0.0
    e = est[ok]
    mad = 1.4826 * np.median(np.abs(e - np.median(e)))
    return float(math.sqrt(max(mad ** 2 - np.median(se[ok] ** 2), 0.0)))


def margin(spread: float, n_tests: int, alpha: float = ALPHA, floor: float = MIN_PREMIUM) -> float:
    """The largest premium a clean feature is expected to reach: the two-sided alpha / n_tests normal
    quantile of the clean spread, at least `floor`."""
    return max(floor, NormalDist().inv_cdf(1 - alpha / (2 * max(n_tests, 1))) * spread)


def upper_p(z: float) -> float:
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2))


def margin_p(est: float, se: float, allowance: float) -> float:
    """One-sided p-value of H0: |premium| <= allowance, from an estimate and its SE."""
    if not (math.isfinite(est) and math.isfinite(se)):
        return 1.0
    return upper_p((abs(est) - allowance) / max(se, 1e-9))


def holm(p: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, *not* capped at 1 (so that they still rank features):
    the k-th smallest p times (n - k + 1), made monotone."""
    order = sorted(range(len(p)), key=lambda k: p[k])
    out, running = [0.0] * len(p), 0.0
    for rank, k in enumerate(order):
        running = max(running, p[k] * (len(p) - rank))
        out[k] = running
    return out


def risk(p_adjusted: float, alpha: float = ALPHA) -> float:
    """A score in (0, 1], 0.5 exactly where the adjusted p-value reaches alpha: alpha / (alpha + p)."""
    return alpha / (alpha + max(p_adjusted, 0.0))
