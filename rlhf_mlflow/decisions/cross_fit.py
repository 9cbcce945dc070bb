"""A better predictor for labelled certification: the reward model with a label head learned from the
labels certify already holds, cross-fitted by prompt.

PPI's interval shrinks with how much of the labels' variance the predictor explains; the calibrated,
corrected reward model explains 0-55% of it on a policy's own samples (docs/CERTIFICATION.md). certify
holds two sets of labels on the family's expert prompts: the expert set (one labelled reference sample
per prompt) and the policy labels. The label head (core/label_head.py: per response position, which
token stands there given the prompt's attributes) is fitted by the lasso to what the reward model,
calibrated to the same labels, leaves unexplained (core/label_head_fit.py), so where the labels say
little the predictor stays the calibrated reward model.

Cross-fitting keeps every estimate unbiased (Zrnic & Candes 2024, cross-prediction-powered inference;
the cross-fitting of double machine learning): the family's distinct prompts are split into `folds`,
and everything on a prompt of fold k (its expert row, its policy labels, the policy's unlabelled
samples on it) is predicted by the head fitted without fold k. So each prompt's predictor never saw that
prompt's labels, the residuals are out-of-sample, and PPI (labelled.py) and the joint estimate
(combine.py) take the predictions as they take the reward model's, one prompt at a time.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rlhf_mlflow.core import label_head_fit as HF
from rlhf_mlflow.core import records as D


@dataclass(frozen=True)
class Predictions:
    """The cross-fitted predictor on a family's arrays (what label_arrays gives for the reward model)."""
    unlabelled: np.ndarray | list  # (P, m): the policy's own samples on the P expert prompts (a table's: P arrays)
    labelled: np.ndarray    # (n,): the labelled responses
    expert: np.ndarray      # (P,): the expert set's reference samples


def prompt_folds(prompts: list[tuple], label_prompts: np.ndarray, folds: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A fold per expert prompt (P,) and per label (n,): the distinct prompts are dealt into `folds` in
    a seeded order, a prompt met twice keeps one fold, and a label on a prompt outside the expert set
    (label_prompts -1) gets a fold of its own by its index."""
    distinct = list(dict.fromkeys(prompts))
    order = np.random.default_rng([seed, 0x9F]).permutation(len(distinct))
    fold_of = {p: int(k) % folds for p, k in zip(distinct, order)}
    expert = np.array([fold_of[p] for p in prompts], int)
    at = np.asarray(label_prompts, int)
    labels = np.where(at >= 0, expert[np.clip(at, 0, None)], np.arange(len(at)) % folds)
    return expert, labels


def cross_fitted(ev: dict, labels: list[dict], label_scores: np.ndarray, at: np.ndarray, folds: int,
                 seed: int = 0, alpha: float = HF.ALPHA) -> Predictions:
    """The predictor on one family's expert rows, labelled responses and the policy's unlabelled samples,
    each prompt's from the head fitted without its fold. `ev` is certify's evidence (family_evidence:
    `ids`, `labels`, `scores`, `policy_ids`, `policy_scores_all`), `labels` the policy labels with their
    (corrected) reward-model scores and expert-prompt rows `at`."""
    P = len(ev["labels"])
    y_lab = torch.tensor([r["label"] for r in labels], dtype=torch.float32)
    lab_ids = torch.cat([D.prompts_tensor(labels), D.responses_tensor(labels)], 1)
    ids = torch.cat([ev["ids"], lab_ids])
    y = torch.cat([torch.as_tensor(ev["labels"], dtype=torch.float32), y_lab])
    trunk = torch.cat([torch.as_tensor(ev["scores"], dtype=torch.float32),
                       torch.as_tensor(label_scores, dtype=torch.float32)])
    fold_xp, fold_lab = prompt_folds(ev.get("fold_prompts", ev["prompts"]), at, folds, seed)
    fold = torch.from_numpy(np.concatenate([fold_xp, fold_lab]))
    pol_ids = ev["policy_ids"]
    group = ev.get("policy_group")  # each unlabelled sample's expert prompt (certify's: K each, in order)
    group = np.repeat(np.arange(P), len(pol_ids) // P) if group is None else np.asarray(group, int)
    pol_trunk = torch.as_tensor(ev["policy_scores_all"], dtype=torch.float32)
    pred, pol_pred = torch.zeros(len(y)), torch.zeros(len(pol_ids))
    pol_fold = torch.from_numpy(fold_xp[group])
    for k, head in enumerate(HF.cross_fitted_heads(ids, y, trunk, fold, alpha)):
        held, pol_held = fold == k, pol_fold == k
        pred[held] = head.combine(ids[held], trunk[held])
        pol_pred[pol_held] = head.combine(pol_ids[pol_held], pol_trunk[pol_held])
    pred, pol_pred = pred.double().numpy(), pol_pred.double().numpy()
    per_prompt = [pol_pred[group == g] for g in range(P)]
    rectangular = len({len(a) for a in per_prompt}) == 1
    return Predictions(np.stack(per_prompt) if rectangular else per_prompt, pred[P:], pred[:P])
