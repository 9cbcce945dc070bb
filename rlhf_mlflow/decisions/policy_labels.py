"""Certify's use of expert labels on the policy's own samples: the arrays PPI is computed from (the
predictor on the policy's unlabelled and labelled samples: the reward model with a label head learned
from the labels, cross-fitted by prompt, cross_fit.py; or the calibrated, corrected reward model
alone), the interval rule a config asks for, and the off-policy evidence the labels are joined with
where the expert set can vouch for the family (labelled.py, combine.py). `cfg` is certify's
CertifyConfig."""
from __future__ import annotations

import numpy as np

from rlhf_mlflow.decisions import cross_fit as X
from rlhf_mlflow.decisions import labelled as L
from rlhf_mlflow.decisions import sequential as S


def label_arrays(row: dict, ev: dict, labels: list[dict], label_scores: np.ndarray | None, cfg
                 ) -> tuple[np.ndarray | list, np.ndarray, np.ndarray, np.ndarray]:
    """What PPI is computed from: the calibrated, corrected reward model's scores (`label_scores` on the
    labelled responses, ev's `policy_scores_all` on the policy's unlabelled samples, by unlabelled prompt:
    K on each of certify's P expert prompts, or a table's prompts as they come), the labels, and per label
    the unlabelled prompt it was drawn on (-1: none). Without scores the predictor is 0 (the labels' own
    mean)."""
    y = np.array([r["label"] for r in labels], float)
    groups = unlabelled_groups(ev)
    if label_scores is None:
        f_unl, f_lab = [np.zeros(len(g)) for g in groups], np.zeros(len(y))
    else:
        a, b = row["calibration"]["intercept"], row["calibration"]["slope"]
        f_unl, f_lab = [a + b * g for g in groups], a + b * np.asarray(label_scores, float)
    return _rectangular(f_unl), f_lab, y, label_prompts(ev, labels)


def unlabelled_groups(ev: dict) -> list[np.ndarray]:
    """The reward model's scores of the policy's unlabelled samples, one array per unlabelled prompt
    (ev's `policy_group`: each sample's prompt; certify's: K samples on each expert prompt in order)."""
    scores = np.asarray(ev["policy_scores_all"], float)
    group = ev.get("policy_group")
    if group is None:
        return list(scores.reshape(len(ev["prompts"]), -1))
    return [scores[group == g] for g in range(len(ev["prompts"]))]


def _rectangular(groups: list[np.ndarray]) -> np.ndarray | list:
    """A (P, m) array when every prompt has m samples (certify's layout), else the list."""
    return np.stack(groups) if len({len(g) for g in groups}) == 1 else groups


def label_rule(cfg, paired: bool = True) -> L.Rule:
    """How labelled intervals are drawn under this config (`paired`: the reference's labels are on the
    unlabelled prompts, in order)."""
    return L.Rule(cfg.level, S.looks_equivalent(cfg.label_spending, cfg.label_look, cfg.label_looks),
                  cfg.label_sequential, cfg.label_widening, cfg.min_labels, paired)


def predictor_arrays(row: dict, ev: dict, labels: list[dict], label_scores: np.ndarray | None, cfg
                     ) -> tuple[np.ndarray | list, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """label_arrays with certify's predictor, plus its predictions on the expert rows (None: the
    calibrated reward model's, the off-policy estimate's own): with scores and cfg.label_folds, where the
    family's arrays allow it (ev's `label_head`, default true: token ids of every row, K samples on each
    expert prompt), the reward model with a label head learned from the expert set and the policy labels,
    cross-fitted by prompt (cross_fit.py)."""
    if label_scores is None or not cfg.label_folds or not ev.get("label_head", True):
        return (*label_arrays(row, ev, labels, label_scores, cfg), None)
    y, at = np.array([r["label"] for r in labels], float), label_prompts(ev, labels)
    p = X.cross_fitted(ev, labels, np.asarray(label_scores, float), at, cfg.label_folds, cfg.seed)
    return p.unlabelled, p.labelled, y, at, p.expert


def label_prompts(ev: dict, labels: list[dict]) -> np.ndarray:
    """Per label, the unlabelled prompt (row of the unlabelled array) it was drawn on (-1: none): by the
    seed's attributes, or a table's prompt."""
    row_of = {p: i for i, p in reversed(list(enumerate(ev["prompts"])))}
    return np.array([row_of.get(r["prompt_key"] if "prompt_key" in r else tuple(r["attrs"]), -1) for r in labels],
                    int)


def expert_evidence(row: dict, ev: dict, cfg, predictions: np.ndarray | None = None) -> dict | None:
    """The off-policy evidence policy labels are joined with (combine.py): only where the expert set can
    vouch for the family (certifiable, with a reward model) and cfg.label_combine. `predictions`: the
    predictor's on the expert rows (default: the calibrated reward model's)."""
    if not (cfg.label_combine and row["certifiable"] and "calibration" in row and "scores" in ev):
        return None
    cal = row["calibration"]
    if predictions is None:
        predictions = cal["intercept"] + cal["slope"] * ev["scores"]
    return {"labels": ev["labels"], "predictions": predictions, "log_ratios": ev["log_ratios"],
            "widening": row["widening"]}


def with_labels(row: dict, ev: dict, labels: list[dict], label_scores: np.ndarray | None, cfg,
                rng: np.random.Generator) -> tuple[dict, np.ndarray | None]:
    """The family's row certified from the policy labels (predictor_arrays; with no scores, the labels'
    own mean), joined with the expert set's off-policy evidence where that can vouch for the family.
    `label_scores`: the (corrected) reward model's scores of the labelled responses."""
    f_unl, f_lab, y, at, f_expert = predictor_arrays(row, ev, labels, label_scores, cfg)
    out, draws = L.with_policy_labels(row, f_unl, f_lab, y, ev["labels"], label_rule(cfg, ev.get("paired", True)),
                                      cfg.n_boot, rng, at, expert_evidence(row, ev, cfg, f_expert))
    if "ppi" in out:
        out["ppi"]["predictor"] = (f"reward model + label head, cross-fitted over {cfg.label_folds} prompt folds"
                                   if f_expert is not None else "reward model" if label_scores is not None else "none")
    return out, draws
