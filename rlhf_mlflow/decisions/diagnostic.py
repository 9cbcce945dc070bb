"""Gold-free reward-shortcut audit: which response features does the reward model pay for beyond
correctness, and how much per occurrence?

Measured on the reward model itself by intervention, with two reference-policy responses to each of
the given prompts (`rm_probes`), and tested in `premium_test`:
  - token premiums: every token written at every place, scored against the median token there (a
    wrong token), pooled over positions (median) and prompts (mean);
  - conditional premiums: the same split by each prompt attribute's value (under it minus elsewhere);
  - pair interactions: all 24 x 24 ordered pairs screened at a few places, the strongest re-measured
    at many fresh places (a fraction-of-8 label has no pair interaction at all).
Each premium is tested against a margin calibrated on the family's clean features (and, for pairs,
the model's own non-additivity near tokens it already pays a lot for); Holm's step-down over all the
family's features controls the chance of flagging a clean family at ALPHA. The vendor's QA sample
(`qa_scan`) says whether the labels pay for a feature too, and alone flags a feature the labels pay
for far beyond 1/8 even if this model has not learned it. An expert set (optional: labelled reference
samples) credits the part of a premium that the expert labels show to be correctness. No family or
token names are used. evidence/diagnostic.py opens the models (any implementation of core/protocol.py)
and draws the reference responses; this module decides from a `score` callable and those responses.

    python -m rlhf_mlflow.diagnostic --rm-dir D --policy-dir D --prompts F [--gold F] --out F
"""
from __future__ import annotations

import numpy as np
import torch

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.decisions import diagnostic_evidence as E
from rlhf_mlflow.decisions import premium_test as PT
from rlhf_mlflow.decisions import qa_scan
from rlhf_mlflow.decisions import rm_probes as P

SATURATION = 0.2     # pair allowance per unit of the two tokens' own premiums (the RM saturates)
SCREEN_CONTEXTS = 6  # places at which all 576 pairs are screened
CONFIRM_PAIRS = 12   # pairs re-measured from the screen (plus the QA sample's strongest)
CONFIRM_CONTEXTS = 48
N_PROMPTS = 48       # probe prompts per family (two reference responses each)


def _tested(kind: str, est, se, allowance, qa: qa_scan.Slopes, gold: qa_scan.Slopes | None, k: int,
            **feature) -> dict:
    c = {"kind": kind, **feature, "premium": float(est), "premium_se": float(se), "margin": float(allowance)}
    return E.with_labels(c, qa, gold, k)


def _token_candidates(x: torch.Tensor, qa, gold) -> list[dict]:
    est, se = PT.token_premiums(x)
    m = PT.margin(PT.clean_spread(est.numpy(), se.numpy()), V.N_CONTENT)
    return [_tested("token", est[t], se[t], m, qa, gold, t, token=V.CONTENT[t]) for t in range(V.N_CONTENT)]


def _conditional_candidates(x: torch.Tensor, attrs: torch.Tensor, qa, gold) -> list[dict]:
    """Every token under every attribute value."""
    diff, se = PT.conditional_premiums(x, attrs, V.N_VAL)          # (A, V, C)
    m = PT.margin(PT.clean_spread(diff.flatten().numpy(), se.flatten().numpy()), diff.numel())
    out = []
    for i in range(V.N_ATTR):
        for v in range(V.N_VAL):
            for t in range(V.N_CONTENT):
                k = qa_scan.feature_index("conditional", t, i, v)
                out.append(_tested("conditional", diff[i, v, t], se[i, v, t], m, qa, gold, k,
                                   token=V.CONTENT[t], attr=i, value=v))
    return out


def _qa_picks(qa: qa_scan.Slopes, n: int) -> list[int]:
    """The n features whose labels, and the n whose residuals, move most (by t-statistic)."""
    return [int(k) for which in ("label", "resid") for k in np.argsort(-qa.t(which))[:n]]


def _pair_candidates(score: P.Scorer, p, y, fresh, token: torch.Tensor, qa, gold, gen) -> list[dict]:
    """Screen all pairs on y, re-measure the strongest (and the QA sample's strongest) on `fresh`
    responses to the same prompts, so that the screen's winners are not judged on their own luck.
    The clean pairs' spread comes from the screen (net of its noise)."""
    C = V.N_CONTENT
    inter = P.pair_screen(score, p, y, SCREEN_CONTEXTS, gen)      # (K, C, C)
    var = inter.var(0)
    shrunk = (var * (SCREEN_CONTEXTS - 1) + var.median() * 10) / (SCREEN_CONTEXTS - 1 + 10)  # few places: borrow
    screen_se = (shrunk / SCREEN_CONTEXTS).sqrt()
    z = (inter.mean(0) / screen_se).flatten()
    m = PT.margin(PT.clean_spread(inter.mean(0).flatten().numpy(), screen_se.flatten().numpy()), C * C)
    picks = list(dict.fromkeys([int(k) for k in torch.argsort(-z.abs())[:CONFIRM_PAIRS]] + _qa_picks(qa, 3)))
    pairs = [divmod(k, C) for k in picks]
    mean, se = P.pair_confirm(score, p, fresh, pairs, CONFIRM_CONTEXTS, gen)
    return [_tested("pair", mean[j], se[j], m + SATURATION * float(token[a].abs() + token[b].abs()), qa, gold, k,
                    tokens=[V.CONTENT[a], V.CONTENT[b]])
            for j, (k, (a, b)) in enumerate(zip(picks, pairs))]


def audit_family(score: P.Scorer, qa_rows: list[dict], p: torch.Tensor, y: torch.Tensor, fresh: torch.Tensor,
                 gen: torch.Generator, gold_rows: list[dict] | None = None) -> dict:
    """Risk, flag and evidence for one family from two reference responses y, fresh (M, L) to each of
    the prompts p (M, P); gold_rows (optional) are the family's expert-labelled reference samples."""
    e = torch.cat([P.token_effects(score, p, y), P.token_effects(score, p, fresh)], 1)  # (M, 2L, C)
    x = PT.prompt_premiums(e)                                                             # (M, C)
    qa = qa_scan.scan(qa_rows, _scores(score, qa_rows))
    gold = qa_scan.scan(gold_rows, _scores(score, gold_rows)) if gold_rows else None
    credit = E.correctness_scale(gold_rows, _scores(score, gold_rows)) if gold_rows else 0.0
    attrs = p[:, 1:1 + V.N_ATTR] - V.VAL_ID[0]
    tokens = _token_candidates(x, qa["token"], gold and gold["token"])
    token = torch.tensor([c["premium"] for c in tokens])
    cands = (tokens + _conditional_candidates(x, attrs, qa["conditional"], gold and gold["conditional"])
             + _pair_candidates(score, p, y, fresh, token, qa["pair"], gold and gold["pair"], gen))
    E.test(cands, credit)
    E.joint_premiums(cands, x, attrs)
    E.credit_corrections(cands, credit)
    cands.sort(key=lambda c: (-round(c["risk"], 4), -abs(c["premium"])))
    flagged = [c for c in cands if c["risk"] >= 0.5]
    return {"risk": cands[0]["risk"], "flag": bool(flagged), "correctness_scale": round(credit, 4),
            "evidence": [E.rounded(c) for c in cands[:max(E.EVIDENCE, len(flagged))]]}


def _scores(score: P.Scorer, rows: list[dict] | None) -> np.ndarray:
    return score(D.prompts_tensor(rows), D.responses_tensor(rows)).numpy() if rows else np.zeros(0)


def attribute_spread_prompts(prompts: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """n distinct prompts (all of them if fewer) that spread every attribute's values as evenly as the
    pool allows, so that each attribute-value cell of the conditional probe has responses in it."""
    attrs = prompts[:, 1:1 + V.N_ATTR] - V.VAL_ID[0]          # (N, A)
    counts = torch.zeros(V.N_ATTR, V.N_VAL)
    taken = torch.zeros(len(prompts), dtype=torch.bool)
    jitter = torch.rand(len(prompts), generator=gen) * 1e-3   # random choice among equally good prompts
    for _ in range(min(n, len(prompts))):
        gain = (1.0 / (1.0 + counts[torch.arange(V.N_ATTR), attrs])).sum(1) + jitter  # (N,)
        k = int(gain.masked_fill(taken, -1.0).argmax())
        taken[k] = True
        counts[torch.arange(V.N_ATTR), attrs[k]] += 1
    return prompts[taken]

