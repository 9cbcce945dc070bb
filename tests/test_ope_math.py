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


def test_population_ess_is_n_over_the_policys_mean_weight():
    n = 100
    assert O.population_ess(np.zeros(50), n) == pytest.approx(n)          # pi = pi_ref
    assert O.population_ess(np.full(50, np.log(4.0)), n) == pytest.approx(n / 4)
    lw = np.log(np.array([1.0, 3.0]))                                     # E_pi[w] = 2
    assert O.population_ess(lw, n) == pytest.approx(n / 2)
    assert O.population_ess(lw + 300.0, n) == pytest.approx(n / 2 * np.exp(-300.0), rel=1e-9)
    assert O.population_ess(lw + 800.0, n) == 0.0                         # no overflow, no NaN
