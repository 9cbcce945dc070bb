"""Certify's use of expert labels on the policy's own samples: the arrays PPI is computed from (the
predictor on the policy's unlabelled and labelled samples: the reward model with a label head learned
from the labels, cross-fitted by prompt, cross_fit.py; or the calibrated, corrected reward model
alone), the interval rule a config asks for, and the off-policy evidence the labels are joined with
where the expert set can vouch for the family (labelled.py, combine.py). `cfg` is certify's
CertifyConfig."""
from __future__ import annotations

import numpy as np

from rlhf_mlflow.core import records as D
from rlhf_mlflow.decisions import cross_fit as X
from rlhf_mlflow.decisions import labelled as L
from rlhf_mlflow.decisions.evidence import scores as _scores


def label_arrays(row: dict, ev: dict, labels: list[dict], rm, wrapper, cfg
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What PPI is computed from: the calibrated, corrected reward model on the policy's unlabelled
    samples (P expert prompts, samples_per_prompt each), on the labelled responses, the labels, and per
    label the expert prompt (row of the unlabelled array) it was drawn on (-1: none). Without a reward
    model the predictor is 0 (the labels' own mean)."""
    y = np.array([r["label"] for r in labels], float)
    prompts = len(ev["labels"])                       # the unlabelled samples: K on each expert prompt
    if rm is None:
        f_unl, f_lab = np.zeros((prompts, cfg.samples_per_prompt)), np.zeros(len(y))
    else:
        a, b = row["calibration"]["intercept"], row["calibration"]["slope"]
        scores = _scores(rm, wrapper, labels, D.prompts_tensor(labels), D.responses_tensor(labels))
        f_unl, f_lab = a + b * ev["policy_scores_all"].reshape(prompts, -1), a + b * scores
    return f_unl, f_lab, y, label_prompts(ev, labels)


def label_rule(cfg) -> L.Rule:
    """How labelled intervals are drawn under this config."""
    return L.Rule(cfg.level, cfg.label_looks, cfg.label_sequential, cfg.label_widening, cfg.min_labels)


def predictor_arrays(row: dict, ev: dict, labels: list[dict], rm, wrapper, cfg
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """label_arrays with certify's predictor, plus its predictions on the expert rows (None: the
    calibrated reward model's, the off-policy estimate's own): with a reward model and cfg.label_folds,
    the reward model with a label head learned from the expert set and the policy labels, cross-fitted
    by prompt (cross_fit.py)."""
    if rm is None or not cfg.label_folds:
        return (*label_arrays(row, ev, labels, rm, wrapper, cfg), None)
    y, at = np.array([r["label"] for r in labels], float), label_prompts(ev, labels)
    scores = _scores(rm, wrapper, labels, D.prompts_tensor(labels), D.responses_tensor(labels))
    p = X.cross_fitted(ev, labels, scores, at, cfg.label_folds, cfg.seed)
    return p.unlabelled, p.labelled, y, at, p.expert


def label_prompts(ev: dict, labels: list[dict]) -> np.ndarray:
    """Per label, the expert prompt (row of the unlabelled array) it was drawn on (-1: none)."""
    row_of = {p: i for i, p in reversed(list(enumerate(ev["prompts"])))}
    return np.array([row_of.get(tuple(r["attrs"]), -1) for r in labels], int)


def expert_evidence(row: dict, ev: dict, cfg, predictions: np.ndarray | None = None) -> dict | None:
    """The off-policy evidence policy labels are joined with (combine.py): only where the expert set can
    vouch for the family (certifiable, with a reward model) and cfg.label_combine. `predictions`: the
    predictor's on the expert rows (default: the calibrated reward model's)."""
    if not (cfg.label_combine and row["certifiable"] and "calibration" in row):
        return None
    cal = row["calibration"]
    if predictions is None:
        predictions = cal["intercept"] + cal["slope"] * ev["scores"]
    return {"labels": ev["labels"], "predictions": predictions, "log_ratios": ev["log_ratios"],
            "widening": row["widening"]}


def with_labels(row: dict, ev: dict, labels: list[dict], rm, wrapper, cfg,
                 rng: np.random.Generator) -> tuple[dict, np.ndarray | None]:
    """The family's row certified from the policy labels (predictor_arrays; none without a reward model:
    then the labels' own mean), joined with the expert set's off-policy evidence where that can vouch
    for the family."""
    f_unl, f_lab, y, at, f_expert = predictor_arrays(row, ev, labels, rm, wrapper, cfg)
    out, draws = L.with_policy_labels(row, f_unl, f_lab, y, ev["labels"], label_rule(cfg), cfg.n_boot, rng, at,
                                      expert_evidence(row, ev, cfg, f_expert))
    if "ppi" in out:
        out["ppi"]["predictor"] = (f"reward model + label head, cross-fitted over {cfg.label_folds} prompt folds"
                                   if f_expert is not None else "reward model" if rm is not None else "none")
    return out, draws
