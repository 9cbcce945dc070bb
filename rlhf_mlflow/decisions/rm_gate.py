"""The reward-model gate: may a repaired reward model take the alias the pipeline trains on?

A pure function of what the repair measured (training/repair_rm.py) and the diagnostic run on the
repaired model. It is refused when, in any family,
  agreement  it agrees worse with the expert labels it did not train on than its parent does on the
             same labels: the paired bootstrap interval of (child r - parent r) lies wholly below 0;
  shortcut   it pays again for a shortcut its parent's diagnostic flagged: the diagnostic on the
             repaired model flags the same feature and finds it paid beyond its margin (what the
             correction would subtract: decisions/correction.fit_corrections). A premium cut from 1.42
             to 0.06 is flagged by the risk alone and is not paid again.
Each failure carries a brief reason (a registry tag shows it whole up to 30 characters).
"""
from __future__ import annotations

from rlhf_mlflow.core import shortcut_rules as SR


def evaluate(agreement: dict, parent_flags: list[dict], child_paid: list[dict]) -> dict[str, dict[str, str]]:
    """{"agreement": {family: reason}, "shortcut": {family: reason}}: empty dicts where it passes.
    `child_paid`: the repaired model's corrections (rules with the premium it pays as `bonus`)."""
    worse = {f: f"r {d['diff']:+.2f} [{d['lo']:+.2f},{d['hi']:+.2f}]"
             for f, d in agreement.get("difference", {}).items() if d["hi"] < 0}
    again = {}
    paid = {SR.describe(r) + "@" + r["family"]: r["bonus"] for r in child_paid}
    for rule in parent_flags:
        premium = paid.get(SR.describe(rule) + "@" + rule["family"])
        if premium is not None:
            again[rule["family"]] = f"pays {SR.describe(rule)} {premium:+.2f}"[:30]
    return {"agreement": worse, "shortcut": again}


def refused(result: dict[str, dict[str, str]]) -> bool:
    return any(result.values())


def summary(result: dict[str, dict[str, str]]) -> str:
    """One line: 'passed', or each failed guardrail with its families."""
    failed = [f"{g}: {', '.join(f'{fam} {why}' for fam, why in fams.items())}" for g, fams in result.items() if fams]
    return "; ".join(failed) or "passed"
