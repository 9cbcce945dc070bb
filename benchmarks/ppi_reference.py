"""The reference estimators certify_accuracy puts beside the project's labelled certification, on the
same labels and the same predictor (the calibrated, corrected reward model):

- `ppi_py`: PPI++ as its authors ship it, `ppi_py.ppi_mean_ci(Y, Yhat, Yhat_unlabeled, alpha)`
  (Angelopoulos, Duchi & Zrnic 2023; package `ppi-python`, the `bench` extra: `pip install -e '.[bench]'`).
  Its power-tuned lam = cov(Y, Yhat) / ((1 + n / N) var(Yhat over all n + N)), clipped to [0, 1]; its
  interval is normal, with the N unlabelled predictions counted as independent (here N = 8 samples on
  each of P = 100 prompts, so the prompts' own spread is counted once per sample, not per prompt);
- `classical`: the labels alone, mean +- Student t (n - 1 df) x s / sqrt(n).

A mix of families (balanced) is the equal-weight mean of the family estimates with the families taken
as independent: se = sqrt(sum se_f^2) / F, a normal interval.
"""
from __future__ import annotations

from statistics import NormalDist

import numpy as np

from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.decisions.labelled import t_quantile

INSTALL = ("ppi_py is not installed: the side-by-side columns need it. Install the benchmark extra with "
           "`.venv/bin/pip install -e '.[bench]'` (ppi-python), or run with --no-ppi-py.")


def ppi_py_interval(y: np.ndarray, f_lab: np.ndarray, f_unl: np.ndarray, level: float) -> tuple[float, float, float]:
    """(estimate, lo, hi) of ppi_py.ppi_mean_ci with its own power tuning; f_unl is flattened (ppi_py has no
    notion of prompts)."""
    try:
        import ppi_py
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit(INSTALL) from e
    y, fl, fu = (np.asarray(a, float).ravel() for a in (y, f_lab, f_unl))
    lo, hi = ppi_py.ppi_mean_ci(y, fl, fu, alpha=1.0 - level)
    lo, hi = float(np.ravel(lo)[0]), float(np.ravel(hi)[0])
    return (lo + hi) / 2, lo, hi


def classical_interval(y: np.ndarray, level: float) -> tuple[float, float, float]:
    """The labels' mean with a Student t interval."""
    y = np.asarray(y, float)
    n = len(y)
    hw = t_quantile(0.5 + level / 2, max(n - 1, 1)) * float(np.std(y, ddof=1)) / np.sqrt(n)
    return float(y.mean()), float(y.mean() - hw), float(y.mean() + hw)


def balanced(intervals: list[tuple[float, float, float]], level: float) -> tuple[float, float, float]:
    """The equal-weight mix of family intervals (estimate, lo, hi), families independent, normal."""
    z = NormalDist().inv_cdf(0.5 + level / 2)
    est = float(np.mean([e for e, _, _ in intervals]))
    se = float(np.sqrt(sum(((hi - lo) / (2 * z)) ** 2 for _, lo, hi in intervals))) / len(intervals)
    return est, est - z * se, est + z * se


def reference_rows(cell: dict, arrays: dict, truth: dict, xp: dict, level: float, with_ppi_py: bool) -> list[dict]:
    """The reference estimators' family and balanced rows on the same labels (ppi_reference.py)."""
    rows = []
    for method in ("ppi_py", "classical") if with_ppi_py else ("classical",):
        fams = {f: (ppi_py_interval(y, fl, fu, level) if method == "ppi_py" else classical_interval(y, level))
                for f, (fu, fl, y, _) in arrays.items()}
        if len(fams) == len(V.FAMILIES):
            fams["balanced"] = balanced(list(fams.values()), level)
        for f, (est, lo, hi) in fams.items():
            rows.append({**cell, "method": method, "family": f, "truth": truth[f"truth/{f}"],
                         "truth_xp": xp[f"truth/{f}"], "certifiable": True, "estimate": est, "lo": lo, "hi": hi,
                         "lo0": None, "hi0": None, "evidence": f"policy labels ({cell['K']})"})
    return rows
