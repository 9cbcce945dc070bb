"""Reward correction: turn the diagnostic's flagged shortcuts into a reward wrapper for train_rl.

For each flagged family, every flagged feature the reward model pays beyond its margin (token /
adjacent pair / attribute-conditional token, the corruption-spec format) becomes a rule whose
`bonus` is what the model pays per occurrence, as the diagnostic measured it on the model by
intervention; the wrapper subtracts `bonus x count` from the reward model's score. What the QA labels
pay for the same features (a joint least-squares fit) is reported beside it as `label_slope`: where
the model learned less than the labels carry, subtracting the label's premium would penalise the
feature even where it is correct. Nothing is read from a world's secret.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

from rlhf_mlflow.core import shortcut_rules as SR
from rlhf_mlflow.core.files import atomic_write_text

WRAPPER_TEMPLATE = '''"""Reward correction fitted by rlhf_mlflow.decisions.correction from the diagnostic's evidence."""
from rlhf_mlflow.decisions.correction import apply_rules

RULES = {rules}


def transform(records, response_tokens, rewards):
    return apply_rules(RULES, records, response_tokens, rewards)
'''


def apply_rules(rules: list[dict], records: list[dict], response_tokens: list[list[str]],
                rewards: list[float]) -> list[float]:
    return [r - sum(rule["bonus"] * SR.count(rule, rec, toks) for rule in rules)
            for rec, toks, r in zip(records, response_tokens, rewards)]


def fit_corrections(diagnostic: dict, qa: list[dict], where: str = "diagnostic") -> list[dict]:
    """Rules (corruption-spec format) for every flagged feature that the reward model pays beyond its
    margin, with `bonus` = the premium the diagnostic measured on the model by intervention and `se`
    its SE, and beside them `label_slope` / `label_se`: what the QA labels pay for the same features
    (fitted jointly by least squares; None where the QA sample cannot say). A malformed `diagnostic`
    is an InputError naming `where` and the bad row (shortcut_rules.check_diagnostic)."""
    rules = []
    for family, res in SR.check_diagnostic(diagnostic, where)["families"].items():
        if not res["flag"]:
            continue
        paid = [c for c in res["evidence"] if c["risk"] >= SR.FLAG_RISK and c.get("paid") and "correction" in c
                and not c.get("credited_away")]
        chosen, seen = [], []
        for c in paid:
            rule = SR.feature(c, family)
            if rule not in seen:
                seen.append(rule)
                chosen.append({**rule, "bonus": round(float(c["correction"]), 5),
                               "se": round(float(c["correction_se"]), 5)})
        slopes = label_slopes(seen, [r for r in qa if r["family"] == family])
        rules += [{**rule, "label_slope": s, "label_se": e} for rule, (s, e) in zip(chosen, slopes)]
    return rules


def label_slopes(features: list[dict], rows: list[dict]) -> list[tuple[float | None, float | None]]:
    """Joint least-squares slopes (and SEs) of the labels on the features' counts, with an intercept."""
    if not features or len(rows) < len(features) + 3:
        return [(None, None)] * len(features)
    x = np.array([[SR.count(rule, r, r["response"]) for rule in features] for r in rows], dtype=float)
    y = np.array([r["label"] for r in rows], dtype=float)
    X = np.column_stack([np.ones(len(rows)), x])
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ coef
    cov = np.linalg.pinv(X.T @ X) * (resid @ resid) / max(len(rows) - X.shape[1], 1)
    return [(round(float(coef[k + 1]), 5), round(float(np.sqrt(cov[k + 1, k + 1])), 5)) for k in range(len(features))]


def write_wrapper(rules: list[dict], path: str) -> str:
    """Write the wrapper file (whole or not at all); returns the sha256 of the bytes written."""
    text = WRAPPER_TEMPLATE.format(rules=json.dumps(rules, indent=1))
    atomic_write_text(path, text)
    return hashlib.sha256(text.encode()).hexdigest()
