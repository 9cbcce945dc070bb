"""The watch for best-of-n: each family's true quality of best-of-n of a policy, for n along a
ladder, estimated from the expert set without a label of the chosen answers, and Gao et al.'s (2022)
best-of-n form, gain = d (alpha - beta d), fitted to it (watch.gao_fit, form "bon").

- d = sqrt(KL_n), KL_n = log n - (n - 1) / n: the analytic KL of best-of-n to the policy it draws
  from (Gao et al., eq. 1), the same for every family.
- Best-of-n's density is not available, so there is no importance-weighted term: the estimate is the
  direct one (watch.direct_estimate: the expert rows' linear calibration of the corrected reward model,
  applied to the chosen answers), its se the bootstrap sd over the expert rows. The calibration is the
  reference's: it transports to best-of-n as far as the reward model's errors do not change with n,
  which is what over-optimisation breaks (a correction removes the flagged part of that).
- Selection uses the raw reward model (what best-of-n optimises); the estimate uses it corrected.
- The chosen answers are nested: best-of-n at each n of the ladder picks among the first n of the
  same n_max samples per expert prompt, so the curve moves only where a larger n finds a better one.
The watch never reads a label of the chosen answers, nor the world's truth. evidence/bon.py draws the
samples and scores them; `chosen_points` decides from the scores.
"""
from __future__ import annotations

import math

import numpy as np

from rlhf_mlflow.decisions import certify as C
from rlhf_mlflow.decisions import watch as W


def bon_kl(n: int) -> float:
    """KL(best-of-n || the policy it draws from), Gao et al.'s analytic form: log n - (n - 1) / n."""
    return math.log(n) - (n - 1) / n


def ladder(n_max: int) -> list[int]:
    """1, 2, 4, ... below n_max, then n_max."""
    ns, n = [], 1
    while n < n_max:
        ns.append(n)
        n *= 2
    return ns + [n_max]


def chosen_points(rows: list[dict], fams: list[str], expert_scores: np.ndarray, raw: np.ndarray,
                  corrected: np.ndarray, ns: list[int], cfg: W.WatchConfig = W.WatchConfig()) -> list[W.WatchPoint]:
    """One WatchPoint per n (its `step` is n) from the expert `rows` (grouped by family, in `fams`' order):
    their corrected scores `expert_scores` (P,), and per expert prompt the raw and corrected scores
    (P, n_max) of n_max samples; best-of-n picks by the raw score among the first n (evidence/bon.py
    draws them)."""
    labels = np.array([r["label"] for r in rows], float)
    spans, at = {}, 0
    for f in fams:
        m = sum(r["family"] == f for r in rows)
        spans[f], at = slice(at, at + m), at + m
    points = []
    for n in sorted(set(ns)):
        chosen = corrected[np.arange(len(rows)), raw[:, :n].argmax(1)]   # per expert prompt
        pt = W.WatchPoint(n, {}, {}, {}, {}, {}, dict.fromkeys(fams, "direct"))
        for i, f in enumerate(fams):
            s = spans[f]
            m = s.stop - s.start
            idx = C.bootstrap_rows(np.random.default_rng(cfg.seed + i), m, cfg.n_boot)  # the same rows at every n
            pt.estimate[f], pt.draws[f] = W.direct_estimate(expert_scores[s], labels[s], chosen[s], idx)
            pt.kl[f], pt.gain[f] = bon_kl(n), pt.estimate[f] - float(labels[s].mean())
        points.append(W.with_balanced(pt, fams))
    return points


def bon_fits(points: list[W.WatchPoint]) -> dict[str, dict]:
    """Each family's best-of-n form fit over the points."""
    return W.point_fits(points, list(points[0].method), "bon")
