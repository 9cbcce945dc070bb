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


PEAK_RANGE, MAX_PEAK_KL = 100.0, 1e3
"""A fitted peak is in range when its KL is at most PEAK_RANGE times the largest KL the family was seen
at, and at most MAX_PEAK_KL nats; beyond that the form is only extrapolated (a family whose gain still
rises, fitted with beta just above 0, puts its 'peak' at KL 1e43)."""


def peak_in_range(fit: dict, max_kl: float) -> bool:
    """Whether the fit has a peak (beta > 0) within the range of KL it can speak for."""
    return fit.get("peak_kl") is not None and fit["peak_kl"] <= min(PEAK_RANGE * max_kl, MAX_PEAK_KL)


def peak_note(fit: dict, max_kl: float) -> str:
    """What a fit says of its family's peak, in words: its KL, or why there is none in range."""
    if fit["alpha"] is None:
        return "no fit (fewer than 2 points with KL > 0)"
    if fit["peak_kl"] is None:
        return f"no peak in range (beta {fit['beta']:.3g} <= 0: the fitted gain still rises)"
    if not peak_in_range(fit, max_kl):
        return (f"no peak in range (the fit's peak KL {fit['peak_kl']:.2g} is past {PEAK_RANGE:g}x the largest "
                f"KL seen, {max_kl:.2g})")
    return f"peak at KL {fit['peak_kl']:.3g}"


def fit_rows(fits: dict[str, dict], points: list) -> list[dict]:
    """One row per family: the fit's form, alpha, beta, the largest KL seen (over `points`, each with a
    `kl` per family), the peak's KL only when in range, and `peak` in words (peak_note)."""
    rows = []
    for f, fit in fits.items():
        max_kl = max((p.kl[f] for p in points), default=0.0)
        rows.append({"family": f, "form": fit["form"], "alpha": fit["alpha"], "beta": fit["beta"], "max_kl": max_kl,
                     "peak_kl": fit["peak_kl"] if peak_in_range(fit, max_kl) else None,
                     "peak": peak_note(fit, max_kl)})
    return rows


def gao_curve(fit: dict, d) -> np.ndarray:
    """The fitted gain at these d (0 at d = 0)."""
    d = np.asarray(d, float)
    safe = np.where(d > 0, d, 1.0)
    return np.where(d > 0, fit["alpha"] * d + fit["beta"] * FORMS[fit.get("form", "rl")][0](safe), 0.0)
