"""The diagnostic's maths on hand-built reward functions and QA samples (no training, seconds).

A "reward model" here is any score(prompts, responses) function, so the probes can be checked
against numbers worked out by hand, and the whole per-family audit against planted premiums.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.decisions import diagnostic, qa_scan
from rlhf_mlflow.decisions import rm_probes as P

C = V.N_CONTENT


def additive(weights: torch.Tensor, pair=None, pair_bonus=0.0, cond=None, cond_bonus=0.0):
    """score = sum of per-token weights (what a fraction-correct label can look like), plus an
    optional premium per adjacent pair (a, b), plus one per token t when attrs[i] == v."""
    def score(prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        c = responses - V.CONTENT_LO
        s = weights[c].sum(1)
        if pair is not None:
            s = s + pair_bonus * ((c[:, :-1] == pair[0]) & (c[:, 1:] == pair[1])).sum(1)
        if cond is not None:
            t, i, v = cond
            on = (prompts[:, 1 + i] - V.VAL_ID[0]) == v
            s = s + cond_bonus * (c == t).sum(1) * on
        return s.float()
    return score


def prompts(n: int, family: str = "birch", seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    attrs = torch.randint(V.N_VAL, (n, V.N_ATTR), generator=g)
    return torch.cat([torch.full((n, 1), V.FAM_ID[family]), attrs + V.VAL_ID[0], torch.full((n, 1), V.SEP)], 1)


def responses(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(V.CONTENT_LO, V.CONTENT_HI, (n, V.RESP_LEN), generator=torch.Generator().manual_seed(seed))


def test_token_effects_of_an_additive_score_are_the_centred_weights():
    w = torch.linspace(0, 0.1, C)
    eff = P.token_effects(additive(w), prompts(3), responses(3))
    assert eff.shape == (3, V.RESP_LEN, C)
    assert torch.allclose(eff, (w - w.mean()).expand(3, V.RESP_LEN, C), atol=1e-5)


def test_pair_probes_find_the_planted_interaction_and_nothing_else():
    w = torch.rand(C, generator=torch.Generator().manual_seed(2)) * 0.1
    score = additive(w, pair=(3, 7), pair_bonus=0.7)
    gen = torch.Generator().manual_seed(0)
    inter = P.pair_screen(score, prompts(8), responses(8), 6, gen)  # (K, C, C)
    mean = inter.mean(0)
    assert divmod(int(mean.abs().argmax()), C) == (3, 7)
    assert mean[3, 7] == pytest.approx(0.7, abs=0.1)
    # an additive score has no interaction: only pairs sharing a token with (3, 7) can see any
    others = torch.ones(C, C, dtype=torch.bool)
    others[3, :] = others[:, 7] = False
    assert mean[others].abs().max() < 1e-5
    m, se = P.pair_confirm(score, prompts(8), responses(8, seed=5), [(3, 7), (7, 3), (0, 1)], 40, gen)
    assert m[0] == pytest.approx(0.7, abs=0.1) and abs(m[2]) < 1e-5 and se[2] < 1e-5


def test_conditional_effects_by_hand():
    per_response = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 0.0], [0.0, 2.0]])  # (M=4, C=2)
    attrs = torch.tensor([[0], [0], [1], [1]])
    diff, se = P.conditional_effects(per_response, attrs, min_group=2)[(0, 0)]
    assert diff.tolist() == pytest.approx([2.0, -1.0])
    var = per_response.var(0)  # [1.6667 (unbiased var of 1,3,0,0), 1.0]
    assert se.tolist() == pytest.approx((var / 2 + var / 2).sqrt().tolist())


def test_partial_slopes_by_hand():
    rng = np.random.default_rng(0)
    control = rng.normal(size=(40, 1))
    x = np.column_stack([rng.integers(0, 3, 40), np.zeros(40)])  # second feature never occurs
    y = 2.0 * x[:, 0] + 3.0 * control[:, 0] + 1.0
    slope, se = qa_scan.partial_slopes(x, y[:, None], control, ridge=0.0)
    assert slope[0, 0] == pytest.approx(2.0) and se[0, 0] == pytest.approx(0.0, abs=1e-6)
    assert np.isnan(slope[0, 1]) and np.isnan(se[0, 1])


@pytest.mark.parametrize("qa_slope, qa_se, weight", [(0.6, 0.1, 1.0), (0.0, 0.05, 0.5), (None, None, 0.85),
                                                    (0.1, 0.2, 0.85)])
def test_qa_labels_weigh_the_reward_models_excess(qa_slope, qa_se, weight):
    c = diagnostic.score_candidate({"kind": "token", "effect": 0.6, "effect_se": 0.01, "bound": 0.125,
                                    "qa_slope": qa_slope, "qa_se": qa_se, "qa_resid": 0.0, "qa_resid_se": 1.0})
    assert c["excess"] == pytest.approx(0.6 - 0.125 - 0.02)
    assert c["risk"] == pytest.approx(weight, abs=1e-3)  # the excess is far past the margin


def test_labels_alone_flag_a_premium_the_model_has_not_learned():
    c = diagnostic.score_candidate({"kind": "pair", "effect": 0.0, "effect_se": 0.01, "bound": 0.0,
                                    "qa_slope": 0.9, "qa_se": 0.1, "qa_resid": 0.9, "qa_resid_se": 0.08})
    assert c["risk"] == pytest.approx(diagnostic.QA_ONLY, abs=0.01)
    c = diagnostic.score_candidate({"kind": "pair", "effect": 0.0, "effect_se": 0.01, "bound": 0.0,
                                    "qa_slope": 0.3, "qa_se": 0.1, "qa_resid": 0.3, "qa_resid_se": 0.1})
    assert c["risk"] < 0.2  # t = 3 among 576 pairs is what chance gives


def _qa(score, n: int, family: str, seed: int, frequent=(3, 7)) -> list[dict]:
    """QA rows labelled by `score` plus noise; a fifth of them contain the pair `frequent`."""
    rnd = random.Random(seed)
    p, y = prompts(n, family, seed), responses(n, seed + 1)
    for r in range(0, n, 5):
        j = rnd.randrange(V.RESP_LEN - 1)
        y[r, j], y[r, j + 1] = frequent[0] + V.CONTENT_LO, frequent[1] + V.CONTENT_LO
    labels = score(p, y) + 0.05 * torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return [{"family": family, "attrs": (p[r, 1:5] - V.VAL_ID[0]).tolist(), "response": V.decode_response(y[r]),
             "label": float(labels[r])} for r in range(n)]


def _audit(score, qa_rows, family="birch"):
    p = prompts(24, family, 3)
    return diagnostic.audit_family(score, qa_rows, p, responses(24, 4), responses(24, 5),
                                   torch.Generator().manual_seed(0))


def test_audit_flags_and_names_a_negative_pair_premium_and_stays_quiet_without_it():
    w = torch.rand(C, generator=torch.Generator().manual_seed(2)) * 0.1
    paid = additive(w, pair=(3, 7), pair_bonus=-0.8)
    res = _audit(paid, _qa(paid, 200, "birch", 9))
    assert res["flag"]
    top = res["evidence"][0]
    assert top["kind"] == "pair" and top["tokens"] == [V.CONTENT[3], V.CONTENT[7]]
    assert top["effect"] == pytest.approx(-0.8, abs=0.1) and top["qa_corroborated"]
    clean = additive(w)
    res = _audit(clean, _qa(clean, 200, "birch", 9))
    assert not res["flag"] and res["risk"] < 0.3


def test_audit_flags_and_names_a_conditional_premium():
    w = torch.rand(C, generator=torch.Generator().manual_seed(2)) * 0.1
    paid = additive(w, cond=(5, 2, 4), cond_bonus=1.0)
    res = _audit(paid, _qa(paid, 200, "birch", 9))
    assert res["flag"]
    named = [(c["kind"], c.get("token"), c.get("attr"), c.get("value")) for c in res["evidence"] if c["risk"] >= 0.5]
    assert ("conditional", V.CONTENT[5], 2, 4) in named
    assert all(kind == "conditional" for kind, *_ in named)


def test_balanced_prompts_put_every_attribute_value_in_the_probe():
    pool = prompts(500, seed=7)
    p = diagnostic.attribute_spread_prompts(pool, 24, torch.Generator().manual_seed(0))
    assert len(p) == 24 and len({tuple(r) for r in p.tolist()}) == 24
    attrs = p[:, 1:1 + V.N_ATTR] - V.VAL_ID[0]
    for i in range(V.N_ATTR):
        counts = torch.bincount(attrs[:, i], minlength=V.N_VAL)  # 3 each on average
        assert counts.min() >= 2 and counts.max() <= 4
    assert len(diagnostic.attribute_spread_prompts(pool[:5], 24, torch.Generator())) == 5
