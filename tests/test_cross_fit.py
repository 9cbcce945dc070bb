"""The labelled predictor (decisions/cross_fit.py): a label head learned from the expert set and the policy
labels, cross-fitted by prompt. On a synthetic family whose truth is local (which token stands at each
position given one prompt attribute, as the label head can express) and a reward model that sees it
through noise: no prompt's prediction depends on its own labels, the learned predictor leaves less of
the labels unexplained than the reward model, and PPI with it still covers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.decisions import cross_fit as X
from rlhf_mlflow.decisions.labelled import half_width, ppi_mean

FAMILY = "birch"


class Family:
    """A family's truth (per position, a key attribute and value -> token table), its prompts, answers
    right at each position with a given probability, and a reward model that sees only the first half
    of the positions (through noise): what it misses, the label head can learn."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.keys = rng.integers(0, V.N_ATTR, V.RESP_LEN)
        self.table = rng.integers(0, V.N_CONTENT, (V.RESP_LEN, V.N_VAL))

    def prompts(self, n: int) -> np.ndarray:
        return self.rng.integers(0, V.N_VAL, (n, V.N_ATTR))

    def right(self, attrs: np.ndarray) -> np.ndarray:
        keyed = np.take_along_axis(attrs, np.broadcast_to(self.keys, (len(attrs), V.RESP_LEN)), 1)
        return self.table[np.arange(V.RESP_LEN)[None], keyed]

    def answer(self, attrs: np.ndarray, skill: float) -> np.ndarray:
        wrong = self.rng.integers(0, V.N_CONTENT, (len(attrs), V.RESP_LEN))
        return np.where(self.rng.random(wrong.shape) < skill, self.right(attrs), wrong)

    def quality(self, attrs: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        return (tokens == self.right(attrs)).mean(1)

    def reward(self, attrs: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        half = V.RESP_LEN // 2
        return (tokens == self.right(attrs))[:, :half].mean(1) + 0.1 * self.rng.standard_normal(len(attrs))

    def ids(self, attrs: np.ndarray, tokens: np.ndarray) -> torch.Tensor:
        fam = np.full((len(attrs), 1), V.FAM_ID[FAMILY])
        sep = np.full((len(attrs), 1), V.SEP)
        return torch.from_numpy(np.concatenate([fam, np.array(V.VAL_ID)[attrs], sep,
                                                np.array(V.CONTENT_ID)[tokens]], 1)).long()


def draw(rng: np.random.Generator, P: int = 60, m: int = 4, n: int = 40, noise: float = 0.03, skill: float = 0.5):
    """(ev, labels, their reward-model scores, label prompts, the policy's true mean) for one family: P
    expert prompts with a reference answer each (right at a position with probability 0.3), the policy's
    m samples on each, n labels on distinct expert prompts."""
    fam = Family(rng)
    attrs = fam.prompts(P)
    ref_tokens = fam.answer(attrs, 0.3)
    pol_attrs = attrs.repeat(m, 0)
    pol_tokens = fam.answer(pol_attrs, skill)
    at = rng.permutation(P)[:n]
    lab_tokens = fam.answer(attrs[at], skill)
    ev = {"labels": fam.quality(attrs, ref_tokens) + noise * rng.standard_normal(P),
          "prompts": [tuple(int(v) for v in a) for a in attrs], "ids": fam.ids(attrs, ref_tokens),
          "scores": fam.reward(attrs, ref_tokens), "policy_ids": fam.ids(pol_attrs, pol_tokens),
          "policy_scores_all": fam.reward(pol_attrs, pol_tokens)}
    lab_q = fam.quality(attrs[at], lab_tokens)
    labels = [{"id": f"l{j}", "family": FAMILY, "attrs": [int(v) for v in attrs[p]],
               "response": V.decode_response((np.array(V.CONTENT_ID)[lab_tokens[j]]).tolist()),
               "label": float(lab_q[j] + noise * rng.standard_normal())} for j, p in enumerate(at)]
    deploy = fam.prompts(20_000)
    truth = float(fam.quality(deploy, fam.answer(deploy, skill)).mean())
    return ev, labels, fam.reward(attrs[at], lab_tokens), at, truth


def test_no_prompt_is_predicted_by_a_head_that_saw_its_labels():
    ev, labels, scores, at, _ = draw(np.random.default_rng(0))
    base = X.cross_fitted(ev, labels, scores, at, folds=5)
    p0 = int(at[0])
    ev2 = dict(ev, labels=ev["labels"].copy())
    ev2["labels"][p0] = 1.0 - ev2["labels"][p0]                     # the prompt's expert label and its policy label moved
    labels2 = [dict(r, label=1.0 - r["label"]) if j == 0 else r for j, r in enumerate(labels)]
    moved = X.cross_fitted(ev2, labels2, scores, at, folds=5)
    # equal up to the solver's tolerance (all folds' lasso problems share one FISTA and its stopping
    # rule); stacking the head by out-of-fold scores, as the repair does, moved them by 0.014
    assert moved.expert[p0] == pytest.approx(base.expert[p0], abs=1e-3)
    assert moved.labelled[0] == pytest.approx(base.labelled[0], abs=1e-3)
    np.testing.assert_allclose(moved.unlabelled[p0], base.unlabelled[p0], atol=1e-3)
    others = np.arange(len(base.expert)) != p0
    assert np.abs(moved.expert[others] - base.expert[others]).max() > 0.01   # the other folds' heads learnt from them


def test_the_learned_predictor_explains_more_of_the_labels_than_the_reward_model():
    ratios = []
    for seed in range(6):
        ev, labels, scores, at, _ = draw(np.random.default_rng(10 + seed), P=100, n=50)
        y = np.array([r["label"] for r in labels])
        crossed = X.cross_fitted(ev, labels, scores, at, folds=10)
        alone, learned = ppi_mean(ev["policy_scores_all"].reshape(100, -1), scores, y, at), \
            ppi_mean(crossed.unlabelled, crossed.labelled, y, at)
        ratios.append(learned.residual_var / alone.residual_var)
    assert np.mean(ratios) < 0.7, ratios


@pytest.mark.slow
def test_ppi_with_the_cross_fitted_predictor_covers():
    """Over 200 families drawn afresh: the 90% t interval about the cross-fitted PPI estimate covers the
    policy's true mean, and is narrower than with the reward model alone."""
    hits, widths, widths_rm = 0, [], []
    for seed in range(200):
        ev, labels, scores, at, truth = draw(np.random.default_rng(1000 + seed), P=100, n=40)
        y = np.array([r["label"] for r in labels])
        crossed = X.cross_fitted(ev, labels, scores, at, folds=10)
        est = ppi_mean(crossed.unlabelled, crossed.labelled, y, at)
        hw = half_width(est.se, len(y), 0.9)
        hits += abs(est.estimate - truth) <= hw
        widths.append(hw)
        widths_rm.append(half_width(ppi_mean(ev["policy_scores_all"].reshape(100, -1), scores, y, at).se, len(y), 0.9))
    assert 0.86 <= hits / 200 <= 0.96
    assert np.mean(widths) < 0.9 * np.mean(widths_rm)
