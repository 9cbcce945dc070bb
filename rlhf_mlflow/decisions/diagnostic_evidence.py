"""The diagnostic's evidence rows: the label side of each tested feature, the family-wide test that
turns premiums into flags, and the premium a correction should subtract.

A row (one feature) carries the reward model's premium per occurrence (`premium`, `premium_se`),
the margin its clean features allow (`margin`), what the labels pay for it (`qa_slope`, `qa_resid`
from the vendor's QA sample; `gold_slope` from an expert set if one was given), the Holm-adjusted
p-value of the model-side test (`p_holm`), whether the model pays it beyond the margin (`paid`),
the risk from the labels alone (`qa_risk`), and `risk` (flagged at 0.5).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.decisions import premium_test as PT
from rlhf_mlflow.decisions import qa_scan

EVIDENCE = 6         # rows reported per family (every flagged one is kept)
TRUTH_BOUND = 1.0 / V.RESP_LEN  # the most one token can change a fraction-of-8 label
QA_ONLY = 0.7        # the most risk QA evidence alone can give
QA_T = {"token": 4.0, "pair": 5.0, "conditional": 5.0}  # |t| a QA slope needs, given how many are scanned
QA_MARGIN, QA_SCALE = 0.075, 0.04  # labels must pay this far beyond 1/8 (softness QA_SCALE) to count alone


def _num(x) -> float | None:
    return None if x is None or not np.isfinite(x) else float(x)


def with_labels(c: dict, qa: qa_scan.Slopes, gold: qa_scan.Slopes | None, k: int) -> dict:
    """Add what the QA labels (and the expert labels, if any) pay for feature column k."""
    c.update(qa_rows=int(qa.rows[k]), qa_slope=_num(qa.label[k]), qa_se=_num(qa.label_se[k]),
             qa_resid=_num(qa.resid[k]), qa_resid_se=_num(qa.resid_se[k]))
    if gold is not None:
        c.update(gold_rows=int(gold.rows[k]), gold_slope=_num(gold.label[k]), gold_se=_num(gold.label_se[k]))
    return c


def correctness_scale(gold_rows: list[dict], scores: np.ndarray) -> float:
    """How far the reward model's scores move per unit of expert label: the share of a correctness
    payment that the model passes on (clipped to [0, 1])."""
    g = np.array([r["label"] for r in gold_rows], dtype=float)
    if len(g) < 3 or g.var() <= 0:
        return 0.0
    return float(np.clip(np.cov(scores, g)[0, 1] / g.var(ddof=1), 0.0, 1.0))


def correctness_credit(c: dict, scale: float) -> float:
    """The part of a premium the expert labels show to be correctness: the model's scale times the
    expert labels' slope (its lower 2-SE bound, in the premium's direction; 0 without an expert set
    and for pairs, which a fraction-of-8 label never pays)."""
    if c["kind"] == "pair" or c.get("gold_slope") is None or c.get("gold_se") is None:
        return 0.0
    toward = c["gold_slope"] * math.copysign(1.0, c["premium"])
    return scale * max(0.0, toward - 2 * c["gold_se"])


def _squash(x: float) -> float:
    return float(1 / (1 + math.exp(-max(min(x, 50.0), -50.0))))


def qa_risk(c: dict) -> float:
    """Risk from the QA labels alone: labels (or their residuals from the model) that pay beyond 1/8
    with a t-statistic above the kind's multiple-testing threshold, up to QA_ONLY: a shortcut in the
    labels that this model has not (fully) learned, but a longer training or another model may."""
    out = 0.0
    if c["qa_slope"] is None:
        return out
    for s, e in ((c["qa_slope"], c["qa_se"]), (c["qa_resid"], c["qa_resid_se"])):
        if s is None or e is None:
            continue
        significant = _squash((abs(s) / max(e, 1e-9) - QA_T[c["kind"]]) / 0.5)
        beyond = _squash((abs(s) - 2 * e - TRUTH_BOUND - QA_MARGIN) / QA_SCALE)
        out = max(out, QA_ONLY * min(significant, beyond))
    return out


def test(cands: list[dict], scale: float = 0.0, alpha: float = PT.ALPHA) -> list[dict]:
    """The family-wide test, in place: each feature's one-sided p-value of H0 |premium| <= margin +
    correctness credit, Holm-adjusted over all of them; risk = max(model-side risk, QA-only risk)."""
    for c in cands:
        c["credit"] = correctness_credit(c, scale)
        c["p"] = PT.margin_p(c["premium"], c["premium_se"], c["margin"] + c["credit"])
    for c, p_holm in zip(cands, PT.holm([c["p"] for c in cands])):
        c["p_holm"] = p_holm
        c["paid"] = bool(p_holm <= alpha)
        slope = c["qa_slope"]
        c["qa_corroborated"] = None if slope is None else bool(
            slope * math.copysign(1.0, c["premium"]) > 2 * c["qa_se"])
        c["qa_risk"] = qa_risk(c)
        c["risk"] = max(PT.risk(p_holm, alpha), c["qa_risk"])
    return cands


def joint_premiums(cands: list[dict], x: torch.Tensor, attrs: torch.Tensor) -> None:
    """`correction` (and its SE) on every flagged feature the model pays: a token's premium and its
    flagged conditions fitted together on the per-prompt premiums x (M, C), so that a correction
    subtracting both does not count the token's premium twice; a pair's is its interaction."""
    paid = [c for c in cands if c["risk"] >= 0.5 and c["paid"]]
    for c in paid:
        c["correction"], c["correction_se"] = c["premium"], c["premium_se"]
    for t in {c["token"] for c in paid if c["kind"] in ("token", "conditional")}:
        conds = [c for c in paid if c["kind"] == "conditional" and c["token"] == t]
        if not conds:
            continue
        cols = [(attrs[:, c["attr"]] == c["value"]).float() for c in conds]
        coef, se = least_squares(torch.stack([torch.ones(len(x))] + cols, 1), x[:, V.CONTENT.index(t)])
        for c, b, s in zip([None] + conds, coef, se):
            if c is None:
                c = next((r for r in paid if r["kind"] == "token" and r["token"] == t), None)
            if c is not None:
                c["correction"], c["correction_se"] = float(b), float(s)


def credit_corrections(cands: list[dict], scale: float) -> None:
    """With an expert set, a flagged feature's `correction` keeps only what the model pays beyond what
    the expert labels pay for it (the model's scale times their slope, a point estimate, in the
    premium's direction): a correction subtracts a shortcut, not correctness; a feature left within
    its margin is `credited_away` and gets no correction rule. A reward model that
    learned the truth's own table from expert labels pays about 1/8 for a token under the right
    attribute value, which the test above may still flag (its credit is a 2-SE lower bound)."""
    for c in cands:
        if "correction" not in c or c.get("gold_slope") is None or c["kind"] == "pair":
            continue
        sign = math.copysign(1.0, c["correction"])
        credited = min(abs(c["correction"]), max(0.0, scale * c["gold_slope"] * sign))
        c["correction_credited"] = credited
        c["correction"] = sign * (abs(c["correction"]) - credited)
        # what is left is within the family's margin: correctness, nothing for a correction to take
        c["credited_away"] = abs(c["correction"]) <= c["margin"]


def least_squares(X: torch.Tensor, y: torch.Tensor) -> tuple[list[float], list[float]]:
    """OLS coefficients of y (n,) on the columns of X (n, k) and their SEs."""
    Xd, yd = X.double(), y.double()
    coef = torch.linalg.lstsq(Xd, yd[:, None]).solution[:, 0]
    resid = yd - Xd @ coef
    dof = max(len(yd) - Xd.shape[1], 1)
    cov = torch.linalg.pinv(Xd.T @ Xd) * float(resid @ resid) / dof
    return coef.tolist(), cov.diagonal().clamp(min=0).sqrt().tolist()


def rounded(c: dict) -> dict:
    return {k: round(v, 5) if isinstance(v, float) else v for k, v in c.items()}
