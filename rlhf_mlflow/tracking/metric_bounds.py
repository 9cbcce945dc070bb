"""What a metric may be before it is charted: finite, and inside the range its kind of number can take
(a quality in [0, 1], a count >= 0, a KL in nats below 1e3, ...). `checked` drops any other value with
a warning naming it, so that no chart's axis is set by a NaN or an extrapolation (a Gao fit's peak at
KL 1e43); every metric the pipeline logs goes through it (tracking/runs.py)."""
from __future__ import annotations

import logging
import math
from fnmatch import fnmatchcase

log = logging.getLogger(__name__)

ANY = (-1e6, 1e6)
"""A name no rule below covers: beyond a million, nothing the pipeline computes is a number to chart."""

QUALITY = (-1, 2)
"""An estimate of true quality from expert labels: the labels' own plausible range (core/records.py
LABEL_RANGES["expert"]: the fraction of 8 positions correct plus the expert's unclipped noise)."""
GAIN = (-3, 3)
"""The difference of two such estimates."""

BOUNDS: tuple[tuple[str, tuple[float, float]], ...] = (
    # a Gao fit's peak, as a KL (decisions/gao.py reports one past its range in words instead)
    ("*/gao_peak_kl/*", (0, 1e3)), ("*/gao_*", ANY),
    # 0/1 flags and outcomes
    ("*/guardrail/*", (0, 1)), ("*/promoted", (0, 1)), ("*/vouched/*", (0, 1)), ("*/past_peak/*", (0, 1)),
    ("diagnostic/flag/*", (0, 1)), ("diagnostic/risk/*", (0, 1)),
    # counts, seconds and rates
    ("*labels*", (0, 1e9)), ("requests/*", (0, 1e9)), ("*/families_*", (0, 1e3)), ("main/candidates_*", (0, 1e3)),
    ("*seconds", (0, 1e7)), ("*_s", (0, 1e7)), ("*/steps_per_s", (0, 1e6)), ("*ess*", (0, 1e9)),
    # standard errors, correlations, shares
    ("*/se/*", (0, 1)), ("*pearson*", (-1, 1)), ("*/top_token_share*", (0, 1)),
    # KL in nats (the k1 estimate of a batch can be a little negative; k3 cannot)
    ("*/kl_k3*", (0, 1e3)), ("*kl*", (-1e3, 1e3)),
    # true quality: the oracle's in [0, 1]; an estimate of it from expert labels (certify's, the watch's)
    # and its interval's ends may pass 0 or 1 by the labels' noise, the interval's width or a doubly
    # robust term, not by a whole unit
    ("truth/*", (0, 1)), ("main/*truth*", (0, 1)), ("main/champion/ceiling_fraction", (0, 10)),
    ("certify/certified*", QUALITY), ("main/champion_certified*", QUALITY), ("sweep/best_certified*", QUALITY),
    ("*/gain*", GAIN),
    ("*/shortcut_rise/*", (-8, 8)), ("watch/*", QUALITY), ("bon/watch/*", QUALITY),
    # per-token entropy (nats, a vocabulary of a few dozen tokens)
    ("*/entropy*", (0, 100)),
)
"""(name pattern, (lowest, highest)): the first pattern (fnmatch, case-sensitive) that matches a
metric's full name bounds it; a name none matches is bounded by ANY."""


def bounds(name: str) -> tuple[float, float]:
    """The range a metric called `name` may take."""
    return next((b for pattern, b in BOUNDS if fnmatchcase(name, pattern)), ANY)


def problem(name: str, value) -> str | None:
    """Why `value` is not a metric `name` to chart (not a number, not finite, out of its range), or None."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return f"{value!r} is not a number"
    if not math.isfinite(v):
        return f"{v} is not finite"
    lo, hi = bounds(name)
    return None if lo <= v <= hi else f"{v:.4g} is outside [{lo:g}, {hi:g}]"


def checked(metrics: dict) -> dict[str, float]:
    """The metrics that are finite and inside their bounds, as floats; each other one is dropped with a
    warning (a bug upstream to fix, not a value to chart)."""
    out = {}
    for name, value in metrics.items():
        why = problem(name, value)
        if why:
            log.warning("metric %s not logged: %s", name, why)
        else:
            out[name] = float(value)
    return out
