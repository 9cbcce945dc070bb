"""One estimate from the expert set (off-policy) and the policy's own labels (decisions/combine.py): the
weights by hand, and by simulation its coverage and what it saves against the labels alone. numpy only."""
from __future__ import annotations

import numpy as np
import pytest

from rlhf_mlflow.decisions import combine as CB
from rlhf_mlflow.decisions.labelled import ppi_mean


def test_the_weight_goes_to_the_less_noisy_correction():
    rng = np.random.default_rng(0)
    P, n = 100, 40
    a = 0.5 + 0.1 * rng.standard_normal(P)
    at = rng.permutation(P)[:n]
    quiet, loud = 0.02 * rng.standard_normal(n), 0.3 * rng.standard_normal(P)
    flat = np.zeros(P)
    labels_win = CB.combine(a, quiet, at, loud, flat, 1.0)
    assert labels_win.alpha > 0.9
    experts_win = CB.combine(a, 10 * quiet, at, 0.01 * loud, flat, 1.0)
    assert experts_win.alpha < 0.1
    # the estimate is the unlabelled mean plus the weighted corrections
    assert experts_win.estimate == pytest.approx(a.mean() + experts_win.alpha * (10 * quiet).mean()
                                                 + (1 - experts_win.alpha) * (0.01 * loud).mean())
    # the off-policy widening makes the expert rows count for less
    assert CB.combine(a, quiet * 5, at, loud / 3, flat, 2.0).alpha > CB.combine(a, quiet * 5, at, loud / 3, flat, 1.0).alpha
    with pytest.raises(ValueError, match="one expert row per unlabelled prompt"):
        CB.combine(a, quiet, at, loud[:50], flat[:50], 1.0)


def test_labels_alone_match_ppi_when_the_expert_rows_say_nothing():
    """alpha = 1 is PPI: with expert residuals of no information its standard error is PPI's."""
    rng = np.random.default_rng(1)
    f = 0.3 + 0.1 * rng.standard_normal((100, 8))
    at = rng.permutation(100)[:30]
    fl = 0.3 + 0.1 * rng.standard_normal(30)
    y = fl + 0.1 * rng.standard_normal(30)
    est = ppi_mean(f, fl, y, at)
    c = CB.combine(est.lam * est.prompt_means, est.residuals, at, 5 * rng.standard_normal(100), np.zeros(100), 1.0)
    assert c.alpha > 0.97
    assert c.se == pytest.approx(est.se, rel=0.08)


def _world(rng: np.random.Generator, P: int = 100, n: int = 20):
    """Responses right (1) or wrong (0); the reference is right with p_ref(x), the policy with p(x), a
    tilt of it; labels = right + expert noise; the predictor a noisy calibrated score."""
    p_ref = rng.beta(2, 3, P)
    p = 1 / (1 + (1 - p_ref) / p_ref * np.exp(-0.6))                  # the policy: odds x e^0.6
    ref_right = rng.random(P) < p_ref
    w = np.where(ref_right, p / p_ref, (1 - p) / (1 - p_ref))
    score = lambda right: 0.2 + 0.5 * right + 0.15 * rng.standard_normal(right.shape)  # noqa: E731
    own = rng.random((P, 8)) < p[:, None]
    at = rng.permutation(P)[:n]
    lab_right = rng.random(n) < p[at]
    gold = ref_right + 0.05 * rng.standard_normal(P)
    y = lab_right + 0.05 * rng.standard_normal(n)
    return score(own), score(lab_right.astype(float)), y, at, gold, score(ref_right.astype(float)), np.log(w)


def test_the_joint_estimate_covers_and_is_narrower_than_the_labels_alone():
    rng = np.random.default_rng(2)
    truth = np.mean([1 / (1 + (1 - q) / q * np.exp(-0.6)) for q in rng.beta(2, 3, 400_000)])
    hits, ppi_hits, width, ppi_width = 0, 0, [], []
    for _ in range(1000):
        fu, fl, y, at, gold, fg, lw = _world(rng)
        est = ppi_mean(fu, fl, y, at)
        c = CB.combine(est.lam * est.prompt_means, est.residuals, at, gold - est.lam * fg, lw, 1.0)
        hits += abs(c.estimate - truth) <= 1.645 * c.se
        ppi_hits += abs(est.estimate - truth) <= 1.645 * est.se
        width.append(c.se)
        ppi_width.append(est.se)
    assert 0.87 <= hits / 1000 <= 0.94
    assert np.mean(width) < 0.85 * np.mean(ppi_width)
