"""Overlap: can the expert set, drawn from the reference, carry an estimate for this policy?

The importance weights w = pi(y|x) / pi_ref(y|x) of the expert rows must not be degenerate (Kish ESS,
the PSIS tail shape k-hat), and the population ESS n / E_pi[w], computed from the policy's OWN samples,
must be large enough too: the rows cannot show mass the policy puts where they never went. `support`
is the one place the refusal rule lives (the policy's own samples it reads, and `weight_support`, which
applies it without reading a label, are gathered in evidence/overlap.py).
"""
from __future__ import annotations

import math


def support(ess: float, khat: float, pop_ess: float, n: int, cfg) -> dict:
    """Whether importance weights with this ESS, tail shape and population ESS (ope_math.population_ess)
    can carry an estimate, and why not."""
    reasons = []
    if ess < cfg.min_ess:
        reasons.append(f"ESS {_below(ess)} < {cfg.min_ess:g} of {n}")
    if khat > cfg.max_khat:
        reasons.append(f"weight tail k-hat {math.ceil(khat * 100) / 100:.2f} > {cfg.max_khat:g}")
    if pop_ess < cfg.min_ess:
        reasons.append(f"population ESS {_below(pop_ess)} < {cfg.min_ess:g} of {n} (from the policy's own samples)")
    return {"certifiable": not reasons, "reason": "; ".join(reasons) if reasons else "ok"}


def _below(x: float) -> str:
    """A number under its threshold, rounded down (9.96 prints as 9.9, never as the 10.0 it is below)."""
    return f"{math.floor(x * 10) / 10:.1f}"
