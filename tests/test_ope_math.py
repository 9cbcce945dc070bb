"""Off-policy estimation maths against hand-computed numbers and known distributions."""
import math

import numpy as np
import pytest

from rlhf_mlflow.decisions import ope_math as O

LOG3 = math.log(3.0)


def test_snips_ess_and_weight_share_by_hand():
    lw, y = np.array([0.0, LOG3]), np.array([0.0, 1.0])    # weights 1 and 3
    assert O.snips(lw, y) == pytest.approx(0.75)
    assert O.kish_ess(lw) == pytest.approx(16 / 10)
    assert O.max_weight_share(lw) == pytest.approx(0.75)


def test_weights_are_shift_invariant_and_stable_for_huge_log_ratios():
    lw = np.array([1000.0, 1000.0 + LOG3])
    assert O.snips(lw, np.array([0.0, 1.0])) == pytest.approx(0.75)
    assert O.kish_ess(np.zeros(50)) == pytest.approx(50.0)


def test_doubly_robust_adds_weighted_residuals_to_the_direct_estimate():
    lw = np.array([0.0, LOG3])
    labels, predictions = np.array([1.0, 0.0]), np.array([0.5, 0.5])
    # 0.5 + (1/4 * 0.5 + 3/4 * -0.5)
    assert O.doubly_robust(lw, labels, predictions, 0.5) == pytest.approx(0.25)
    # a perfect direct model needs no correction, whatever the weights
    assert O.doubly_robust(lw, labels, labels, 0.4) == pytest.approx(0.4)


def test_linear_calibration_recovers_a_line():
    a, b = O.linear_calibration(np.array([0.0, 1.0, 2.0]), np.array([1.0, 3.0, 5.0]), ridge=0.0)
    assert (a, b) == pytest.approx((1.0, 2.0))
    a, b = O.linear_calibration(np.ones(4), np.array([0.0, 1.0, 0.0, 1.0]))  # constant scores: slope 0
    assert b == 0.0 and a == pytest.approx(0.5)


def test_gpd_fit_recovers_a_known_shape():
    rng = np.random.default_rng(0)
    for k in (0.2, 0.5, 0.9):
        u = rng.random(4000)
        x = ((1 - u) ** (-k) - 1) / k                      # generalised Pareto, sigma = 1
        k_hat, sigma = O.gpd_fit(x)
        assert k_hat == pytest.approx(k, abs=0.08)
        assert sigma == pytest.approx(1.0, rel=0.15)


def test_pareto_khat_separates_light_and_heavy_weight_tails():
    def mean_khat(draw):
        return np.mean([O.pareto_khat(draw(np.random.default_rng(s))) for s in range(10)])
    light = mean_khat(lambda r: r.normal(0.0, 0.3, 2000))                  # log-normal, small spread
    heavy = mean_khat(lambda r: np.log(r.pareto(1.0 / 1.2, 2000) + 1.0))   # Lomax: k = 1.2
    assert light < 0.3
    assert heavy == pytest.approx(1.2, abs=0.15)
    assert O.pareto_khat(np.zeros(100)) == -math.inf        # equal weights: no tail


def test_tied_weights_are_no_tail_to_fit():
    """Zero excesses (weights tied at the cutoff) are not a tail: the fit through them gave 35 and 333."""
    few = np.zeros(300)
    few[:3] = 1.0                                            # three weights of e among 297 equal ones
    assert O.pareto_khat(few) == -math.inf
    rounded = np.zeros(300)
    rounded[:30] = 1e-7 * np.random.default_rng(0).integers(1, 3, 30)   # a policy a hair from the reference
    assert O.pareto_khat(rounded) < 0.7
    # a real tail beside ties is still found: Lomax (k = 1.2) weights above a block of equal ones
    lw = np.log(np.random.default_rng(1).pareto(1.0 / 1.2, 2000) + 1.0)
    lw[:500] = lw.min()
    assert O.pareto_khat(lw) == pytest.approx(1.2, abs=0.2)


def test_population_ess_is_n_over_the_policys_mean_weight():
    n = 100
    assert O.population_ess(np.zeros(50), n) == pytest.approx(n)          # pi = pi_ref
    assert O.population_ess(np.full(50, np.log(4.0)), n) == pytest.approx(n / 4)
    lw = np.log(np.array([1.0, 3.0]))                                     # E_pi[w] = 2
    assert O.population_ess(lw, n) == pytest.approx(n / 2)
    assert O.population_ess(lw + 300.0, n) == pytest.approx(n / 2 * np.exp(-300.0), rel=1e-9)
    assert O.population_ess(lw + 800.0, n) == 0.0                         # no overflow, no NaN


def test_small_sample_widening_by_hand():
    assert O.small_sample_widening(25.0, 10.0) == pytest.approx(np.sqrt(1.4))
    assert O.small_sample_widening(25.0, k=0.0) == 1.0
    assert O.small_sample_widening(1e9, 20.0) == pytest.approx(1.0)
    assert O.small_sample_widening(0.2, 10.0) == pytest.approx(np.sqrt(11.0))  # ESS below 1 counts as 1


def _evidence(rng, n=80, spread=1.2):
    """One family's certify evidence drawn from a synthetic world: the reference samples a feature x,
    the policy tilts towards it (log-ratio spread * x, normalised), quality and reward model both
    rise with x. Returns the evidence and the policy's true mean quality."""
    x = rng.standard_normal(n)
    log_norm = spread ** 2 / 2                                    # log E_ref[exp(spread * x)]
    lw = spread * x - log_norm
    quality = lambda v: 0.3 + 0.05 * v  # noqa: E731
    y = quality(x) + 0.1 * rng.standard_normal(n)
    xs = rng.standard_normal((n, 8)) + spread                     # the policy's own samples: x ~ N(spread, 1)
    own_lw = spread * xs - log_norm
    scores = x + rng.standard_normal(n)
    own_scores = xs + rng.standard_normal((n, 8))
    ev = {"log_ratios": lw, "labels": y, "kl": float(own_lw.mean()), "shortcuts": [],
          "pop_ess": O.population_ess(own_lw.ravel(), n), "scores": scores, "policy_scores": own_scores.mean(1)}
    return ev, quality(spread)


def test_the_widened_interval_keeps_the_estimate_and_covers_better_at_low_ess():
    from rlhf_mlflow.decisions.certify import CertifyConfig, bootstrap_rows, estimate_family
    widened, bare = CertifyConfig(n_boot=500), CertifyConfig(n_boot=500, ess_widening=0.0)
    rng = np.random.default_rng(0)
    hits = {"widened": 0, "bare": 0}
    given = 0
    for rep in range(200):
        ev, truth = _evidence(rng)
        idx = bootstrap_rows(np.random.default_rng(rep), len(ev["labels"]), 500)
        row, _, _ = estimate_family(ev, widened, idx)
        row0, _, _ = estimate_family(ev, bare, idx)
        if not row["certifiable"]:
            continue
        given += 1
        c = O.small_sample_widening(min(row["ess"], row["pop_ess"]), widened.ess_widening)
        assert row["widening"] == pytest.approx(c) and c > 1.0
        assert row["estimate"] == row0["estimate"]
        assert row["hi"] - row["estimate"] == pytest.approx(c * (row0["hi"] - row0["estimate"]))
        assert row["estimate"] - row["lo"] == pytest.approx(c * (row0["estimate"] - row0["lo"]))
        hits["widened"] += row["lo"] <= truth <= row["hi"]
        hits["bare"] += row0["lo"] <= truth <= row0["hi"]
    assert given >= 100
    assert hits["widened"] / given >= 0.88 and hits["widened"] > hits["bare"]


def test_mix_widening_by_hand():
    assert O.mix_widening([1 / 6] * 6, [0.03] * 6, 0.1) == pytest.approx(np.sqrt(1.5))
    assert O.mix_widening([1 / 6] * 6, [0.03] * 6, 0.0) == 1.0
    assert O.mix_widening([1.0], [0.03], 0.3) == pytest.approx(1.0)            # one family: nothing to correlate
    assert O.mix_widening([0.5, 0.5], [0.02, 0.02], 1.0) == pytest.approx(np.sqrt(2.0))  # perfectly correlated
    assert O.mix_widening([0.5, 0.5], [0.0, 0.0], 0.2) == 1.0                  # no spread to widen


def test_the_balanced_interval_covers_when_family_errors_correlate_and_keeps_its_estimate():
    """Six families whose estimation errors share a common part (correlation 0.1 across expert sets),
    each family's draws of the right spread: the mix of independent draws is too narrow; the mix
    widened for that correlation covers about as often as it claims (90%; 82% without)."""
    from dataclasses import replace

    from rlhf_mlflow.decisions.certify import CertifyConfig, aggregate
    cfg = CertifyConfig(n_boot=400)
    fams = [f"f{i}" for i in range(6)]
    rng = np.random.default_rng(0)
    sd, rho, hits, hits0 = 0.03, 0.1, 0, 0
    for rep in range(400):
        shared = rng.standard_normal()
        err = sd * (np.sqrt(rho) * shared + np.sqrt(1 - rho) * rng.standard_normal(6))
        rows = {f: {"certifiable": True, "estimate": 0.4 + e, "reference": 0.3} for f, e in zip(fams, err)}
        draws = {f: rows[f]["estimate"] + sd * rng.standard_normal(cfg.n_boot) for f in fams}
        ref_draws = {f: 0.3 + 0.01 * rng.standard_normal(cfg.n_boot) for f in fams}
        b = aggregate(rows, draws, ref_draws, dict.fromkeys(fams, 1.0), cfg)
        b0 = aggregate(rows, draws, ref_draws, dict.fromkeys(fams, 1.0), replace(cfg, family_correlation=0.0))
        assert b["estimate"] == b0["estimate"] and b["gain"] == b0["gain"]
        assert b["hi"] - b["lo"] == pytest.approx(np.sqrt(1.5) * (b0["hi"] - b0["lo"]), rel=0.02)
        assert b["gain_hi"] - b["gain_lo"] > b0["gain_hi"] - b0["gain_lo"]
        hits += b["lo"] <= 0.4 <= b["hi"]
        hits0 += b0["lo"] <= 0.4 <= b0["hi"]
    assert hits0 / 400 < 0.85 and hits / 400 >= 0.87
