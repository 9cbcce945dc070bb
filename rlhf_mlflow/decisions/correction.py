"""Reward correction: turn the diagnostic's flagged shortcuts into a reward wrapper for train_rl.

For each flagged family, the flagged features (token / adjacent pair / attribute-conditional token,
the corruption-spec format) are refitted jointly on the vendor's QA sample by least squares, and
the wrapper subtracts `bonus x count` from the reward model's score. Only features the diagnostic
flagged are corrected; nothing is read from a world's secret.
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


def fit_corrections(diagnostic: dict, qa: list[dict], min_excess: float = 0.0) -> list[dict]:
    """Rules (corruption-spec format, with fitted `bonus` and `se`) for every flagged family's
    candidates whose reward-model effect exceeds the 1/8 bound (those the model actually pays)."""
    rules = []
    for family, res in diagnostic["families"].items():
        if not res["flag"]:
            continue
        chosen = [SR.feature(c, family) for c in res["evidence"]
                  if c["risk"] >= 0.5 and c["excess"] > min_excess]
        chosen = [r for i, r in enumerate(chosen) if r not in chosen[:i]]
        rows = [r for r in qa if r["family"] == family]
        if not chosen or len(rows) < len(chosen) + 3:
            continue
        x = np.array([[SR.count(rule, r, r["response"]) for rule in chosen] for r in rows], dtype=float)
        y = np.array([r["label"] for r in rows], dtype=float)
        X = np.column_stack([np.ones(len(rows)), x])
        coef, *_ = np.linalg.lstsq(X, y, rcond=None)
        resid = y - X @ coef
        cov = np.linalg.pinv(X.T @ X) * (resid @ resid) / max(len(rows) - X.shape[1], 1)
        for k, rule in enumerate(chosen):
            rules.append({**rule, "bonus": round(float(coef[k + 1]), 5), "se": round(float(np.sqrt(cov[k + 1, k + 1])), 5)})
    return rules


def write_wrapper(rules: list[dict], path: str) -> str:
    """Write the wrapper file (whole or not at all); returns the sha256 of the bytes written."""
    text = WRAPPER_TEMPLATE.format(rules=json.dumps(rules, indent=1))
    atomic_write_text(path, text)
    return hashlib.sha256(text.encode()).hexdigest()
