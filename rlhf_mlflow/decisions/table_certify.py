"""Certification from tables: a policy trained anywhere, certified from its logged samples.

The same certification as certify's (decisions/certify.py): per family, prediction-powered inference
with the reward model's score as the predictor (labelled.py: PPI++, the same interval rule, looks,
widening and refusals), joined with the expert set's off-policy evidence where that can vouch for the
family, and the balanced (deployment) mix; only the arrays come from files a user wrote from any stack
(core/tables.py) instead of from models run here:

- the predictor on the unlabelled samples: each sample's `score`, by prompt, calibrated (least
  squares) on the expert set's scores when it has them, else taken as it is (PPI++'s weight absorbs
  the scale);
- the labelled rows: the samples the labels name (the labels remove the predictor's bias);
- the reference's quality: the expert set's labels (the gain over the reference pairs prompt by prompt
  where the samples' prompts are the expert set's, one group each, in order: certify's layout);
- off-policy evidence: the expert rows' `logp_policy` - `logp_reference` (and the samples' own, for
  the population ESS); KL per family: the samples' mean of the same difference;
- the label head (cross_fit.py) where every row carries the seed's tokens and the samples sit on the
  expert set's prompts; shortcut counts (marker collapse) where rows carry the seed's tokens.
A family the table cannot speak for is refused, saying why, exactly as certify refuses one.
"""
from __future__ import annotations

from dataclasses import asdict

import numpy as np
import torch

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import shortcut_rules as SR
from rlhf_mlflow.core import tables as TB
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.digest import content_sha256
from rlhf_mlflow.decisions import ope_math as O
from rlhf_mlflow.decisions.certify import ESTIMATOR_VERSION, CertifyConfig, aggregate, estimate_families
from rlhf_mlflow.decisions.label_requests import labels_used

TABLE_INPUTS = ("samples", "labels", "expert_set", "diagnostic")
MIN_EXPERT_ROWS = 10
"""An expert set's family with fewer rows than this gives its reference quality but no off-policy estimate."""


def certify_table(samples: list[dict], labels: dict[str, float], expert: list[dict] | None = None,
                  cfg: CertifyConfig = CertifyConfig(), shortcuts: list[dict] | None = None) -> dict:
    """The certification report (certify's format) of the policy whose samples these are. `labels`:
    {sample id: expert label}; `expert`: the expert set's rows (core/tables.read_expert_set), None for
    none (then no reference quality: gains are unknown); `shortcuts`: the diagnostic's flagged rules
    (None: none looked for; marker collapse is then unknown)."""
    by_family = {f: [r for r in samples if r["family"] == f] for f in V.FAMILIES}
    experts = {f: [r for r in expert or [] if r["family"] == f] for f in V.FAMILIES}
    countable = shortcuts is not None and all(r["seed"] is not None for r in [*samples, *(expert or [])])
    evidence, labelled, label_scores = {}, {}, {}
    for f, rows in by_family.items():
        if not rows:
            continue
        evidence[f], labelled_f = family_arrays(rows, labels, experts[f], shortcuts if countable else [], cfg)
        if labelled_f:
            labelled[f], label_scores[f] = labelled_f, np.array([r["score"] for r in labelled_f], float)
    known = all(experts[f] for f in evidence)
    if not known:  # no reference quality: computed against 0, reported as unknown
        for ev in evidence.values():
            ev["labels"] = ev["labels"] if len(ev["labels"]) else np.zeros(0)
    rows, draws, ref_draws = estimate_families(evidence, labelled, label_scores, cfg)
    balanced = aggregate({f: {**r, "reference": r["reference"] or 0.0} for f, r in rows.items()}, draws, ref_draws,
                         {f: 1.0 for f in V.FAMILIES}, cfg)
    if not known:
        for row in [*rows.values(), balanced]:
            row.update(reference=None, gain=None, gain_lo=None, gain_hi=None)
    return {"estimator": ESTIMATOR_VERSION, "kind": "table", "families": rows, "balanced": balanced,
            "config": asdict(cfg), "shortcut_rules": shortcuts if countable else None,
            **({} if countable or shortcuts is None else
               {"shortcut_note": "the flagged shortcuts were not counted: rows without the seed's tokens"})}


def table_report(inputs: dict, cfg: CertifyConfig = CertifyConfig(), shortcuts: list[dict] | None = None,
                 recorded_rules: bool = False) -> dict:
    """certify_table of the tables at `inputs` (paths: samples, labels, optional expert_set and
    diagnostic), read and checked (core/tables.py), with its inputs and their sha256 (what release
    recomputes it from). `recorded_rules`: count `shortcuts` (a recomputation) instead of the diagnostic's."""
    samples = TB.read_samples(inputs["samples"])
    labels = TB.read_labels(inputs["labels"], samples, inputs["samples"])
    expert = TB.read_expert_set(inputs["expert_set"]) if inputs.get("expert_set") else None
    if not recorded_rules:
        shortcuts = SR.flagged_from(inputs["diagnostic"]) if inputs.get("diagnostic") else None
    report = certify_table(samples, labels, expert, cfg, shortcuts)
    report["inputs"] = {k: inputs.get(k) for k in TABLE_INPUTS}
    report["input_sha256"] = {k: content_sha256(v) for k, v in report["inputs"].items() if v}
    if inputs.get("expert_set"):
        report["input_sha256"]["gold"] = report["input_sha256"]["expert_set"]  # what champions are compared on
    family_of = {r["id"]: r["family"] for r in samples}
    report["labels_used"] = labels_used(inputs["labels"], report["input_sha256"]["labels"],
                                        [{"id": rid, "family": family_of[rid]} for rid in labels],
                                        {"samples": inputs["samples"], "samples_sha256": report["input_sha256"]["samples"]})
    return report


def family_arrays(rows: list[dict], labels: dict[str, float], expert: list[dict], rules: list[dict],
                  cfg: CertifyConfig) -> tuple[dict, list[dict]]:
    """One family's evidence (the arrays certify's estimators read) and its labelled rows (records with
    `label` and `prompt_key`, and the seed's fields when the row has them)."""
    unlabelled = [r for r in rows if r["id"] not in labels]
    labelled = [{**(r["seed"] or {"id": r["id"], "family": r["family"]}), "label": labels[r["id"]],
                 "prompt_key": r["prompt_key"], "score": r["score"]} for r in rows if r["id"] in labels]
    keys = _group_order(unlabelled, expert)
    group_of = {k: g for g, k in enumerate(keys)}
    unlabelled.sort(key=lambda r: group_of[r["prompt_key"]])  # stable: a prompt's samples keep their order
    expert_keys = [r["prompt_key"] for r in expert]
    aligned = bool(expert) and expert_keys == keys and len(set(expert_keys)) == len(expert_keys)
    text = {r["prompt_key"]: r["prompt_text"] for r in unlabelled}
    ev = {"labels": np.array([r["label"] for r in expert], float), "prompts": keys, "paired": aligned,
          "fold_prompts": [text[k] for k in keys],
          "policy_scores_all": np.array([r["score"] for r in unlabelled], float),
          "policy_group": np.array([group_of[r["prompt_key"]] for r in unlabelled], int),
          "kl": _kl(unlabelled), "shortcuts": _counts(rules, unlabelled, expert),
          "calibration": _calibration(expert)}
    _off_policy(ev, unlabelled, expert, aligned)
    _label_head(ev, unlabelled, labelled, expert, aligned)
    return ev, labelled


def _group_order(unlabelled: list[dict], expert: list[dict]) -> list:
    """The unlabelled samples' prompts: the expert set's first (its order), then the rest as they come."""
    present = dict.fromkeys(r["prompt_key"] for r in unlabelled)
    first = [k for k in dict.fromkeys(r["prompt_key"] for r in expert) if k in present]
    return first + [k for k in present if k not in set(first)]


def _kl(unlabelled: list[dict]) -> float | None:
    """KL(policy || reference) per response, the mean of the policy's own samples' log-ratios (None
    without their log-probs)."""
    if not unlabelled or any("logp_policy" not in r for r in unlabelled):
        return None
    return float(np.mean([r["logp_policy"] - r["logp_reference"] for r in unlabelled]))


def _calibration(expert: list[dict]) -> dict:
    """The reward model's scores calibrated to the expert labels (least squares), when the expert set
    has scores; else the identity."""
    if len(expert) < 3 or any("score" not in r for r in expert):
        return {"intercept": 0.0, "slope": 1.0, "r": None}
    s, y = np.array([r["score"] for r in expert]), np.array([r["label"] for r in expert])
    a, b = O.linear_calibration(s, y)
    return {"intercept": a, "slope": b, "r": float(np.corrcoef(s, y)[0, 1]) if s.std() > 0 else 0.0}


def _off_policy(ev: dict, unlabelled: list[dict], expert: list[dict], aligned: bool) -> None:
    """The expert set as off-policy evidence when its rows and the samples carry both log-probs (the
    doubly-robust estimate needs the samples on the expert prompts: `aligned`); else why not."""
    if len(expert) < MIN_EXPERT_ROWS or any("logp_policy" not in r for r in [*expert, *unlabelled]) or not unlabelled:
        ev["why_not"] = ("no off-policy evidence: " + (
            f"the expert set has {len(expert)} rows of this family (< {MIN_EXPERT_ROWS})" if len(expert) < MIN_EXPERT_ROWS
            else "its rows and the samples need logp_policy and logp_reference"))
        return
    ev["log_ratios"] = np.array([r["logp_policy"] - r["logp_reference"] for r in expert], float)
    own = np.array([r["logp_policy"] - r["logp_reference"] for r in unlabelled], float)
    ev["pop_ess"] = O.population_ess(own, len(expert))
    if aligned and all("score" in r for r in expert):
        ev["scores"] = np.array([r["score"] for r in expert], float)
        group = ev["policy_group"]
        ev["policy_scores"] = np.array([ev["policy_scores_all"][group == g].mean() for g in range(len(expert))])


def _label_head(ev: dict, unlabelled: list[dict], labelled: list[dict], expert: list[dict], aligned: bool) -> None:
    """The token ids cross_fit.py learns the label head from, where the table allows it: the seed's
    fields on every row, scores on the expert rows, and the samples on the expert set's prompts."""
    ok = (aligned and all(r.get("seed") for r in [*unlabelled, *expert])
          and all("attrs" in r for r in labelled) and all("score" in r for r in expert))
    ev["label_head"] = ok
    if ok:
        seeds = [r["seed"] for r in expert]
        own = [r["seed"] for r in unlabelled]
        ev["ids"] = torch.cat([D.prompts_tensor(seeds), D.responses_tensor(seeds)], 1)
        ev["policy_ids"] = torch.cat([D.prompts_tensor(own), D.responses_tensor(own)], 1)
        ev["scores"] = np.array([r["score"] for r in expert], float)


def _counts(rules: list[dict], unlabelled: list[dict], expert: list[dict]) -> list[dict]:
    """Each flagged shortcut of the family with its mean count per answer among the policy's samples and
    the expert set's reference samples (their standard error beside the policy's)."""
    out = []
    family = (unlabelled or expert or [{}])[0].get("family")
    for rule in (r for r in rules if r["family"] == family):
        counts = {}
        for who, rows in (("policy", unlabelled), ("reference", expert)):
            seeds = [r["seed"] for r in rows]
            c = SR.counts(rule, D.prompts_tensor(seeds), D.responses_tensor(seeds)).double() if seeds else torch.zeros(1)
            counts[who] = (float(c.mean()), float(c.std() / np.sqrt(len(c))) if len(c) > 1 else 0.0)
        out.append({**rule, "policy_count": counts["policy"][0], "policy_count_se": counts["policy"][1],
                    "reference_count": counts["reference"][0]})
    return out
