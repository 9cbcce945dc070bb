"""A family mix's certified quality: `balanced` (equal family weights: deployment traffic) or `pilot` (a
prompt file's mix), from each family's row and bootstrap (or interval) draws; certifiable only when every
family with weight is, its interval widened for the families' correlated errors (ope_math.mix_widening)."""
from __future__ import annotations

import numpy as np

from rlhf_mlflow.decisions import ope_math as O


def aggregate(rows: dict, draws: dict, ref_draws: dict, weights: dict[str, float], cfg) -> dict:
    """A family mix: certifiable only if every family with weight is (`cfg`: certify's CertifyConfig: its
    level and family_correlation)."""
    fams = [f for f, w in weights.items() if w > 0]
    total = sum(weights[f] for f in fams)
    wt = {f: weights[f] / total for f in fams}
    out = {"weights": wt, "reference": sum(wt[f] * rows[f]["reference"] for f in fams)}
    missing = [f for f in fams if f not in rows]
    refused = [f for f in fams if f in rows and not rows[f]["certifiable"]]
    if missing or refused:
        why = ([f"no expert rows for {', '.join(missing)}"] if missing else []) + \
              ([f"not certifiable: {', '.join(refused)}"] if refused else [])
        return {**out, "certifiable": False, "reason": "; ".join(why), "estimate": None, "lo": None, "hi": None,
                "gain": None, "gain_lo": None, "gain_hi": None}
    est = sum(wt[f] * rows[f]["estimate"] for f in fams)
    gain = est - out["reference"]
    w = [wt[f] for f in fams]
    gains = {f: draws[f] - ref_draws[f] for f in fams}
    d = est + O.mix_widening(w, [float(np.std(draws[f])) for f in fams], cfg.family_correlation) * \
        (sum(wt[f] * draws[f] for f in fams) - est)
    g = gain + O.mix_widening(w, [float(np.std(gains[f])) for f in fams], cfg.family_correlation) * \
        (sum(wt[f] * gains[f] for f in fams) - gain)
    lo_q, hi_q = (1 - cfg.level) / 2, (1 + cfg.level) / 2
    return {**out, "certifiable": True, "reason": "ok", "estimate": est,
            "lo": float(np.quantile(d, lo_q)), "hi": float(np.quantile(d, hi_q)),
            "gain": gain, "gain_lo": float(np.quantile(g, lo_q)),
            "gain_hi": float(np.quantile(g, hi_q))}
