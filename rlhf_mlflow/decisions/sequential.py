"""Anytime-valid intervals for labels bought in rounds: an asymptotic confidence sequence (Waudby-Smith,
Arbour, Sinha, Kennedy & Ramdas 2021, "Time-uniform central limit theory and asymptotic confidence
sequences", Theorem 2.2: the two-sided Gaussian-mixture boundary).

For a running mean of n i.i.d. terms with standard deviation sigma, the intervals

    mean_n +- sigma * sqrt(2 (n rho^2 + 1) / (n^2 rho^2) * log(sqrt(n rho^2 + 1) / alpha))

cover the true mean at every n at once with probability -> 1 - alpha (Ville's inequality on the
Gaussian-mixture martingale, which the CLT's strong approximation carries over to sample means). So a
caller may look after every batch of labels and stop whenever it likes (once a guardrail is decided):
the interval it stops on is valid, whatever the stopping rule. rho tunes where the boundary is
tightest: rho^2 = (-2 log alpha + log(1 - 2 log alpha)) / n_opt makes it tightest at n_opt labels.

Here the mean is PPI's: the labels' residuals (y - lam f) arrive one by one while the predictor's mean over
the unlabelled samples is fixed before the first label, so the boundary's multiplier of the standard
error at n labels, `multiplier(n)` = sqrt(n) x the unit-variance margin, is applied to the estimate's
whole standard error (labels and unlabelled term together; the fixed term is the same at every look and
only makes the looks' errors more alike). tests/test_sequential.py checks by simulation that stopping at
the first look where a guardrail is decided keeps the coverage.

A spending rule (`spending_shares`) is the other way to look several times: each look gets its own share
of the error budget, fixed before the first, so a look where the caller mostly stops can have most of it
(labelled.py applies it as a union bound over 1 / share looks).

What it costs: at alpha = 0.10 the multiplier is 2.76 at n_opt (2.86 at n_opt / 2.5), against 1.645 for
one look, 2.24 for a union bound over 4 planned looks and 2.54 over 9: it pays for every look there
could be, so it is the cheaper rule only beyond ~15 looks (docs/CERTIFICATION.md).
"""
from __future__ import annotations

import math

from rlhf_mlflow.core.errors import InputError


def rho2_for(n_opt: float, alpha: float) -> float:
    """The mixture's rho^2 that makes the boundary tightest at n_opt terms (Waudby-Smith et al. 2021)."""
    if n_opt <= 0 or not 0 < alpha < 1:
        raise ValueError(f"n_opt must be > 0 and alpha in (0, 1), got {n_opt}, {alpha}")
    return (-2 * math.log(alpha) + math.log(1 - 2 * math.log(alpha))) / n_opt


def margin(n: float, rho2: float, alpha: float) -> float:
    """The two-sided Gaussian-mixture boundary for the mean of n unit-variance terms."""
    return math.sqrt(2 * (n * rho2 + 1) / (n * n * rho2) * math.log(math.sqrt(n * rho2 + 1) / alpha))


def multiplier(n: int, level: float, n_opt: int) -> float:
    """What multiplies a mean's standard error at n terms for the confidence sequence at `level`, tightest
    at n_opt terms (in place of the normal quantile 1.645 of one look at 90%)."""
    alpha = 1.0 - level
    return margin(max(n, 1), rho2_for(n_opt, alpha), alpha) * math.sqrt(max(n, 1))


MAX_LOOKS = 1000
"""The most looks a spending rule may name."""


def spending_shares(text: str) -> tuple[float, ...]:
    """The shares of a spending rule ("0.7,0.1,0.1,0.1": look k's share of the error budget), checked:
    each finite and > 0, at most MAX_LOOKS of them, adding up to at most 1; "" is no spending rule."""
    if not str(text).strip():
        return ()
    try:
        shares = tuple(float(v) for v in str(text).split(","))
    except ValueError:
        raise InputError(f"label_spending {text!r}: comma-separated numbers, e.g. 0.7,0.1,0.1,0.1") from None
    if len(shares) > MAX_LOOKS or not all(math.isfinite(v) and v > 0 for v in shares) or sum(shares) > 1 + 1e-9:
        raise InputError(f"label_spending {text!r}: at most {MAX_LOOKS} shares, each > 0, adding up to at most 1")
    return shares


def looks_equivalent(spending: str, look: int, looks: int) -> float:
    """The number of looks a union bound would split the error budget over to give look `look` its share
    under `spending` (1 / share); without a spending rule, `looks` itself."""
    shares = spending_shares(spending)
    return 1.0 / shares[look - 1] if shares else looks
