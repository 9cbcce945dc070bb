"""The diagnostic's maths on hand-built reward functions and QA samples (no training, seconds).

A "reward model" here is any score(prompts, responses) function, so the probes can be checked
against numbers worked out by hand, and the whole per-family audit against planted premiums.
"""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.decisions import diagnostic, qa_scan
from rlhf_mlflow.decisions import diagnostic_evidence as E
from rlhf_mlflow.decisions import premium_test as PT
from rlhf_mlflow.decisions import rm_probes as P

C = V.N_CONTENT


def noisy(score, sd: float):
    """score plus a fixed pseudo-random amount per (prompt, response), uniform with SD sd: what a
    trained reward model's context effects look like to the probes."""
    primes = torch.tensor([3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47])

    def scored(prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        h = (torch.cat([prompts, responses], 1) * primes[:prompts.shape[1] + responses.shape[1]] ** 3).sum(1)
        u = ((h * 2654435761) % 1000003).float() / 1000003 - 0.5
        return score(prompts, responses) + sd * math.sqrt(12) * u
    return scored


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


def test_prompt_premiums_score_each_token_against_the_median_token_at_each_place():
    # one prompt, two places, three tokens: the median token at each place is a wrong one
    s = torch.tensor([[[0.0, 1.0, 0.2],     # place 0: token 1 correct (+1), median 0.2
                       [0.1, 0.3, 0.0]]])   # place 1: median 0.1
    x = PT.prompt_premiums(s)               # median over places of s - median over tokens
    assert x.shape == (1, 3)
    assert x[0].tolist() == pytest.approx([(-0.2 + 0.0) / 2, (0.8 + 0.2) / 2, (0.0 - 0.1) / 2])


def test_a_token_correct_at_a_minority_of_places_has_no_premium_but_a_premium_shows_everywhere():
    M, L, C = 6, 8, 24
    s = torch.zeros(M, L, C)
    s[:, :3, 5] = 0.125            # token 5 correct at 3 of 8 places: the truth pays it there only
    s[:, :, 9] += 0.1              # token 9: a premium at every place
    s[:, 2, 9] += 0.125            # ... and correct at one place
    est, se = PT.token_premiums(PT.prompt_premiums(s))
    assert est[5] == pytest.approx(0.0) and est[9] == pytest.approx(0.1) and float(se.abs().max()) == 0.0


def test_conditional_premiums_by_hand():
    x = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 0.0], [0.0, 2.0]])  # (M=4, C=2)
    attrs = torch.tensor([[0], [0], [1], [1]])
    diff, se = PT.conditional_premiums(x, attrs, n_val=2)
    assert diff[0, 0].tolist() == pytest.approx([2.0, -1.0])
    # pooled within-group variance: token 0 (2 + 0) / 2 = 1, token 1 (0 + 2) / 2 = 1
    assert se[0, 0].tolist() == pytest.approx([1.0, 1.0])
    assert diff[0, 1].tolist() == pytest.approx([-2.0, 1.0])
    diff, _ = PT.conditional_premiums(x[:3], attrs[:3], n_val=2)
    assert torch.isnan(diff[0]).all()  # a group of one prompt is not enough


def test_clean_spread_is_the_mad_net_of_sampling_noise():
    est = np.array([-0.02, -0.01, 0.0, 0.01, 0.02, 0.9])  # one paid feature barely moves it
    mad = 1.4826 * 0.015                                    # |est - median 0.005|: .025 .015 .005 .005 .015 .895
    assert PT.clean_spread(est, np.full(6, 0.0)) == pytest.approx(mad)
    assert PT.clean_spread(est, np.full(6, 0.01)) == pytest.approx(np.sqrt(mad ** 2 - 0.01 ** 2))
    assert PT.clean_spread(est, np.full(6, 1.0)) == 0.0


def test_margin_is_the_bonferroni_quantile_of_the_clean_spread_with_a_floor():
    # 24 features at alpha 0.05: the two-sided 0.05 / 24 normal quantile is 3.0782
    assert PT.margin(0.02, 24) == pytest.approx(3.0782 * 0.02, rel=1e-3)
    assert PT.margin(0.001, 24) == PT.MIN_PREMIUM


def test_margin_p_and_holm_by_hand():
    assert PT.margin_p(0.15, 0.025, 0.1) == pytest.approx(1 - 0.97725, abs=1e-5)  # z = 2
    assert PT.margin_p(-0.15, 0.025, 0.1) == PT.margin_p(0.15, 0.025, 0.1)       # either sign
    assert PT.margin_p(float("nan"), 0.1, 0.1) == 1.0
    # p = .01, .04, .03, .5: sorted .01*4, .03*3, .04*2, .5*1, made monotone
    assert PT.holm([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])
    assert PT.risk(PT.ALPHA) == 0.5 and PT.risk(0.0) == 1.0 and PT.risk(10.0) < 0.01


def _row(kind="token", premium=0.0, se=0.01, margin=0.05, **labels):
    row = {"kind": kind, "premium": premium, "premium_se": se, "margin": margin, "qa_slope": None, "qa_se": None,
           "qa_resid": None, "qa_resid_se": None}
    return {**row, **labels}


def test_the_family_test_flags_a_premium_beyond_its_margin_after_holm():
    rows = [_row(premium=0.02 * (k % 3)) for k in range(99)] + [_row(premium=0.1, se=0.01)]
    E.test(rows)
    # z = (0.1 - 0.05) / 0.01 = 5: p = 2.87e-7, times 100 tests
    assert rows[-1]["p_holm"] == pytest.approx(100 * 2.8665e-7, rel=1e-3) and rows[-1]["paid"]
    assert rows[-1]["risk"] > 0.99 and max(r["risk"] for r in rows[:-1]) < 0.01
    rows = [_row(premium=0.02 * (k % 3)) for k in range(99)] + [_row(premium=0.07, se=0.01)]
    E.test(rows)  # z = 2: 0.023 * 100 is far beyond alpha
    assert not rows[-1]["paid"] and rows[-1]["risk"] < 0.05


def test_labels_alone_flag_a_premium_the_model_has_not_learned():
    c = E.test([_row("pair", qa_slope=0.9, qa_se=0.1, qa_resid=0.9, qa_resid_se=0.08)])[0]
    assert not c["paid"] and c["risk"] == pytest.approx(E.QA_ONLY, abs=0.01)
    c = E.test([_row("pair", qa_slope=0.3, qa_se=0.1, qa_resid=0.3, qa_resid_se=0.1)])[0]
    assert c["risk"] < 0.2  # t = 3 among 576 pairs is what chance gives


def test_expert_labels_credit_the_correctness_part():
    c = _row(premium=0.12, gold_slope=0.2, gold_se=0.05)
    assert E.correctness_credit(c, 0.5) == pytest.approx(0.5 * (0.2 - 0.1))
    assert E.correctness_credit({**c, "premium": -0.12}, 0.5) == 0.0   # labels pay the other way
    assert E.correctness_credit({**c, "kind": "pair"}, 0.5) == 0.0     # a label pays no pair interaction
    rows = [{"label": g} for g in (0.0, 0.25, 0.5, 0.75)]
    assert E.correctness_scale(rows, np.array([0.1, 0.2, 0.3, 0.4])) == pytest.approx(0.4)


def test_joint_premiums_split_a_token_from_its_condition():
    # per-prompt premiums of token 'ba': 0.2 everywhere, 0.5 more when attrs[1] == 3
    attrs = torch.tensor([[0, 3], [1, 3], [0, 0], [1, 1], [2, 2], [0, 3]])
    x = torch.zeros(6, V.N_CONTENT)
    x[:, 0] = 0.2 + 0.5 * (attrs[:, 1] == 3).float()
    token = {**_row(premium=0.35), "token": "ba", "risk": 1.0, "paid": True}
    cond = {**_row("conditional", premium=0.5), "token": "ba", "attr": 1, "value": 3, "risk": 1.0, "paid": True}
    E.joint_premiums([token, cond], x, attrs)
    assert token["correction"] == pytest.approx(0.2) and cond["correction"] == pytest.approx(0.5)
    assert token["correction_se"] == pytest.approx(0.0, abs=1e-9)


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


def _audit(score, qa_rows, family="birch", n=24):
    p = prompts(n, family, 3)
    return diagnostic.audit_family(score, qa_rows, p, responses(n, 4), responses(n, 5),
                                   torch.Generator().manual_seed(0))


def test_audit_flags_and_names_a_negative_pair_premium_and_stays_quiet_without_it():
    w = torch.rand(C, generator=torch.Generator().manual_seed(2)) * 0.1
    paid = additive(w, pair=(3, 7), pair_bonus=-0.8)
    res = _audit(paid, _qa(paid, 200, "birch", 9))
    assert res["flag"]
    top = res["evidence"][0]
    assert top["kind"] == "pair" and top["tokens"] == [V.CONTENT[3], V.CONTENT[7]]
    assert top["premium"] == pytest.approx(-0.8, abs=0.1) and top["qa_corroborated"] and top["paid"]
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


def test_audit_flags_a_weak_token_premium_and_subtracts_what_the_model_pays():
    w = torch.rand(C, generator=torch.Generator().manual_seed(2)) * 0.03
    premium = w.clone()
    premium[4] += 0.12
    res = _audit(noisy(additive(premium), 0.02), [])
    flagged = [c for c in res["evidence"] if c["risk"] >= 0.5]
    assert res["flag"] and [(c["kind"], c["token"]) for c in flagged] == [("token", V.CONTENT[4])]
    # its premium against the median token (w's median is the wrong tokens' level)
    assert flagged[0]["correction"] == pytest.approx(0.12 + float(w[4] - w.median()), abs=0.01)
    res = _audit(noisy(additive(w), 0.02), [])
    assert not res["flag"] and res["risk"] < 0.1


def test_audit_flags_a_weak_conditional_premium():
    w = torch.rand(C, generator=torch.Generator().manual_seed(2)) * 0.03
    res = _audit(noisy(additive(w, cond=(5, 2, 4), cond_bonus=0.12), 0.02), [], n=48)
    named = [(c["kind"], c.get("token"), c.get("attr"), c.get("value")) for c in res["evidence"] if c["risk"] >= 0.5]
    assert named == [("conditional", V.CONTENT[5], 2, 4)]
