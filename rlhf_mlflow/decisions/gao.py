"""Gao et al. (2022)'s functional forms of true gain against d = sqrt(KL), fitted by weighted least
squares: RL's d (alpha - beta log d) and best-of-n's d (alpha - beta d), their peaks and curves (the
watch's fit, decisions/watch.py)."""
from __future__ import annotations

import math

import numpy as np

MIN_KL = 1e-5
"""A KL estimate below this is float32 rounding of the sequence log-probs, not a policy that moved (the
reference against itself reads 0 to 3e-7 nats): such points carry no d for the fit."""


FORMS = {"rl": (lambda d: -d * np.log(d), lambda alpha, beta: math.exp(min(alpha / beta - 1, 50.0))),
         "bon": (lambda d: -d * d, lambda alpha, beta: alpha / (2 * beta))}
"""Gao et al.'s two forms, gain = alpha d + beta * second(d): RL's d (alpha - beta log d), peak
exp(alpha/beta - 1); best-of-n's d (alpha - beta d), peak alpha / (2 beta). Each: (second, peak_d)."""


def gao_fit(d, gain, se, form: str = "rl") -> dict:
    """Weighted least squares (weights 1/se^2) of the `form`'s gain (FORMS) over the points with
    d^2 >= MIN_KL; its peak_d and peak_kl = peak_d^2 when beta > 0 (else None: no peak in the
    fitted form)."""
    second, peak_of = FORMS[form]
    d, gain, se = (np.asarray(x, float) for x in (d, gain, se))
    keep = d * d >= MIN_KL
    d, gain, w = d[keep], gain[keep], 1.0 / np.maximum(se[keep], 1e-6)  # sqrt of the weights 1/se^2
    if len(d) < 2:
        return {"form": form, "alpha": None, "beta": None, "peak_d": None, "peak_kl": None}
    X = np.stack([d, second(d)], 1)                                     # (n, 2)
    (alpha, beta), *_ = np.linalg.lstsq(X * w[:, None], gain * w, rcond=None)
    peak = peak_of(alpha, beta) if beta > 0 else None
    return {"form": form, "alpha": float(alpha), "beta": float(beta), "peak_d": peak,
            "peak_kl": None if peak is None else peak * peak}


def fit_metrics(fits: dict[str, dict]) -> dict[str, float]:
    """The fits' metric names (without a prefix): gao_alpha/<family>, gao_beta/..., gao_peak_kl/...,
    for the fits that have them."""
    return {f"gao_{k}/{f}": fit[k] for f, fit in fits.items() for k in ("alpha", "beta", "peak_kl")
            if fit[k] is not None}


def gao_curve(fit: dict, d) -> np.ndarray:
    """The fitted gain at these d (0 at d = 0)."""
    d = np.asarray(d, float)
    safe = np.where(d > 0, d, 1.0)
    return np.where(d > 0, fit["alpha"] * d + fit["beta"] * FORMS[fit.get("form", "rl")][0](safe), 0.0)
