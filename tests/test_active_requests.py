"""The reweighted estimate benchmarks/active_requests.py compares designs with: unbiased under any request
probabilities, narrower only where they follow the residuals, and covering at its level."""
import importlib.util
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("benchmarks.active_requests",
                                              os.path.join(ROOT, "benchmarks", "active_requests.py"))
AR = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = AR
spec.loader.exec_module(AR)


def test_requests_where_the_predictor_errs_narrow_the_interval_and_blind_ones_do_not():
    rng = np.random.default_rng(3)
    n = 2000
    q = rng.uniform(0, 1, n)
    f = q + rng.normal(0, 1, n) * np.where(rng.uniform(size=n) < 0.2, 0.3, 0.02)   # a fifth of the answers err a lot
    blind = rng.uniform(0.5, 1.5, n)
    uniform = AR.draws(f, q, None, 30, 2000, 0.2, 0.0, np.random.default_rng(0))
    told = AR.draws(f, q, np.abs(q - f), 30, 2000, 0.2, 0.0, np.random.default_rng(0))
    guess = AR.draws(f, q, blind, 30, 2000, 0.2, 0.0, np.random.default_rng(0))
    assert told[0] < 0.75 * uniform[0]                      # told where it errs: much narrower
    assert 0.95 * uniform[0] < guess[0] < 1.2 * uniform[0]  # a signal blind to the errors: no gain
    assert all(c > 0.85 for _, c in (uniform, told, guess))  # and every design covers the pool's truth
