"""certify_accuracy's labelled cells re-estimated from the arrays an earlier run kept (`--arrays F`), with
the estimator as the code now computes it: what certify does with policy labels (policy_labels.py,
labelled.py, combine.py, the balanced mix) and the reference estimators beside it, without sampling,
labelling or training anything again (`--from-arrays F`)."""
from __future__ import annotations

import numpy as np

from benchmarks.ppi_reference import reference_rows
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.decisions import certify as C
from rlhf_mlflow.decisions import labelled as L

KEPT = ("log_ratios", "labels", "scores", "policy_scores", "pop_ess", "prompts")
"""The evidence kept per family with --arrays: what the off-policy estimate and the join need."""


def ours(cell: dict, cfg: C.CertifyConfig) -> dict:
    """{family: row, "balanced": row} as certify computes them from the cell's labels and evidence."""
    rows, draws = {}, {}
    crossed = cfg.label_folds and "ours_arrays" in cell   # kept before estimator 7: the reward model's arrays
    for f, arrays in (cell["ours_arrays"] if crossed else cell["arrays"]).items():
        f_unl, f_lab, y, at, f_expert = arrays if crossed else (*arrays, None)
        row, ev = cell["off"][f], cell["evidence"][f]
        rng = np.random.default_rng([cfg.seed, 1 + V.FAMILIES.index(f)])
        rows[f], draws[f] = L.with_policy_labels(row, f_unl, f_lab, y, ev["labels"], C.label_rule(cfg), cfg.n_boot,
                                                 rng, at, C.expert_evidence(row, ev, cfg, f_expert))
    if len(rows) == len(V.FAMILIES) and all(d is not None or not rows[f]["certifiable"] for f, d in draws.items()):
        zeros = {f: np.zeros(cfg.n_boot) for f in rows}   # the gain's draws: not reported here
        rows["balanced"] = C.aggregate(rows, draws, zeros, {f: 1.0 for f in V.FAMILIES}, cfg)
    return rows


def recompute(cells: list[dict], cfg: C.CertifyConfig, with_ppi_py: bool) -> list[dict]:
    """The report rows (ours, ppi_py, classical) of every kept cell."""
    out = []
    for cell in cells:
        meta = {k: v for k, v in cell.items() if k not in ("truth", "truth_xp", "off", "arrays", "evidence")}
        truth, xp = cell["truth"], cell["truth_xp"]
        for f, r in ours(cell, cfg).items():
            out.append({**meta, "method": "ours", "family": f, "truth": truth[f"truth/{f}"],
                        "truth_xp": xp[f"truth/{f}"], "certifiable": r["certifiable"], "estimate": r["estimate"],
                        "lo": r["lo"], "hi": r["hi"], "lo0": None, "hi0": None,
                        "evidence": r.get("evidence", "expert set"), "labels_weight": r.get("evidence_weights", {}).get("policy_labels")})
        out += reference_rows(meta, cell["arrays"], truth, xp, cfg.level, with_ppi_py)
    return out
