"""Gold-free reward-shortcut audit: which response features does the reward model pay for beyond
what a fraction-of-8-correct label can explain?

Under the label contract (quality = fraction of 8 positions correct) writing one token changes true
quality by at most 1/8, and an adjacent pair is worth exactly the sum of its two tokens (the label
is a sum over positions, so its pair interaction is zero). We measure, on the reward model itself,
with reference-policy responses to the given prompts (`rm_probes`):
  - token effects: every token at every position of every response, judged against 1/8;
  - pair interactions: all 24 x 24 ordered pairs screened at a few places, the strongest re-measured
    at many fresh places, judged against zero (plus the model's own non-additivity near tokens it
    already pays a lot for);
  - conditional effects: the token effect split by each prompt attribute's value, against 1/8;
and weigh each candidate by the vendor's QA sample (`qa_scan`: do the labels move with the feature,
holding token counts fixed?). No expert labels, no family or token names are used.

    python -m rlhf_mlflow.diagnostic --rm-dir D --policy-dir D --prompts F --out F
"""
from __future__ import annotations

import functools
import math
import os

import numpy as np
import torch

from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core import rollout
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.decisions import qa_scan
from rlhf_mlflow.decisions import rm_probes as P

TRUTH_BOUND = 1.0 / V.RESP_LEN  # the most one token can change a fraction-of-8 label
MARGIN = 0.075       # allowance for the reward model's fitting error beyond the bound
SCALE = 0.04         # softness of risk around the threshold
SATURATION = 0.2     # pair allowance per unit of the two tokens' own effects (the RM saturates)
SCREEN_CONTEXTS = 6  # places at which all 576 pairs are screened
CONFIRM_PAIRS = 12   # pairs re-measured from the screen (plus the QA sample's strongest)
CONFIRM_CONTEXTS = 32
EVIDENCE = 6         # candidates reported per family (every flagged one is kept)
QA_ONLY = 0.7        # the most risk QA evidence alone can give
QA_T = {"token": 4.0, "pair": 5.0, "conditional": 5.0}  # |t| a QA slope needs, given how many are scanned


def _risk(excess: float) -> float:
    return float(1 / (1 + math.exp(-max(min((excess - MARGIN) / SCALE, 50.0), -50.0))))


def _num(x) -> float | None:
    return None if x is None or not np.isfinite(x) else float(x)


def score_candidate(c: dict) -> dict:
    """Risk of one candidate from the reward model's effect beyond its bound and the QA labels.

    The reward model's effect beyond what a label allows is what RL will exploit. The QA sample
    weighs it: labels that pay for it too (slope 2 SE beyond zero, same sign) give full weight; labels
    that clearly pay less than the model (slope 2.5 SE short of the excess) halve it, since the model's
    effect is then more likely its own fitting artefact; no or inconclusive QA evidence gives 0.85.
    Labels (or their residuals from the model) that pay beyond the bound with a t-statistic above
    the kind's multiple-testing threshold count on their own, up to 0.7: a shortcut in the labels
    that this model has not (fully) learned, but a longer training or another model may.
    """
    c["excess"] = abs(c["effect"]) - c["bound"] - 2 * c["effect_se"] - c.get("allowance", 0.0)
    weight, qa_risk, c["qa_corroborated"] = 0.85, 0.0, None
    if c["qa_slope"] is not None:
        slope, se = c["qa_slope"], c["qa_se"]
        toward = slope * math.copysign(1.0, c["effect"])
        c["qa_corroborated"] = bool(toward > 2 * se)
        if c["qa_corroborated"]:
            weight = 1.0
        elif toward + 2.5 * se < abs(c["effect"]) - c["bound"] - c.get("allowance", 0.0):
            weight = 0.5
        for s, e in ((slope, se), (c["qa_resid"], c["qa_resid_se"])):
            significant = 1 / (1 + math.exp(-min(abs(s) / max(e, 1e-9) - QA_T[c["kind"]], 25.0) / 0.5))
            qa_risk = max(qa_risk, QA_ONLY * min(significant, _risk(abs(s) - 2 * e - TRUTH_BOUND)))
    c["qa_risk"] = qa_risk
    c["risk"] = max(_risk(c["excess"]) * weight, qa_risk)
    return c


def _candidate(kind: str, effect: float, se: float, bound: float, qa: qa_scan.Slopes, k: int, **feature) -> dict:
    return {"kind": kind, **feature, "effect": float(effect), "effect_se": float(se), "bound": bound,
            "qa_rows": int(qa.rows[k]), "qa_slope": _num(qa.label[k]), "qa_se": _num(qa.label_se[k]),
            "qa_resid": _num(qa.resid[k]), "qa_resid_se": _num(qa.resid_se[k])}


def _qa_picks(qa: qa_scan.Slopes, n: int) -> list[int]:
    """The n features whose labels, and the n whose residuals, move most (by t-statistic)."""
    return [int(k) for which in ("label", "resid") for k in np.argsort(-qa.t(which))[:n]]


def _token_candidates(eff: torch.Tensor, qa: qa_scan.Slopes) -> list[dict]:
    per_resp = eff.mean(1)                                     # (M, C)
    mean, se = per_resp.mean(0), per_resp.std(0) / math.sqrt(per_resp.shape[0])
    return [_candidate("token", mean[t], se[t], TRUTH_BOUND, qa, t, token=V.CONTENT[t])
            for t in range(V.N_CONTENT)]


def _pair_candidates(score: P.Scorer, p, y, fresh, token: torch.Tensor, qa: qa_scan.Slopes, gen) -> list[dict]:
    """Screen all pairs on y, re-measure the strongest (and the QA sample's strongest) on `fresh`
    responses to the same prompts, so that the screen's winners are not judged on their own luck."""
    C = V.N_CONTENT
    inter = P.pair_screen(score, p, y, SCREEN_CONTEXTS, gen)      # (K, C, C)
    var = inter.var(0)
    shrunk = (var * (SCREEN_CONTEXTS - 1) + var.median() * 10) / (SCREEN_CONTEXTS - 1 + 10)  # few places: borrow
    z = (inter.mean(0) / (shrunk / SCREEN_CONTEXTS).sqrt()).flatten()
    picks = list(dict.fromkeys([int(k) for k in torch.argsort(-z.abs())[:CONFIRM_PAIRS]] + _qa_picks(qa, 3)))
    pairs = [divmod(k, C) for k in picks]
    mean, se = P.pair_confirm(score, p, fresh, pairs, CONFIRM_CONTEXTS, gen)
    return [_candidate("pair", mean[j], se[j], 0.0, qa, k, tokens=[V.CONTENT[a], V.CONTENT[b]],
                       allowance=SATURATION * float(token[a].abs() + token[b].abs()))
            for j, (k, (a, b)) in enumerate(zip(picks, pairs))]


def _conditional_candidates(eff: torch.Tensor, p: torch.Tensor, qa: qa_scan.Slopes) -> list[dict]:
    """Per attribute value, the token whose effect moves most with it, plus the QA sample's picks."""
    attrs = p[:, 1:1 + V.N_ATTR] - V.VAL_ID[0]                # (M, A)
    cells = P.conditional_effects(eff.mean(1), attrs)
    wanted = {(int(diff.abs().argmax()), i, v) for (i, v), (diff, _) in cells.items()}
    wanted |= {(k // (V.N_ATTR * V.N_VAL), (k // V.N_VAL) % V.N_ATTR, k % V.N_VAL) for k in _qa_picks(qa, 4)}
    out = []
    for t, i, v in sorted(wanted):
        # a cell no probe prompt falls in has no model effect to report: the QA labels speak alone
        diff, se = cells.get((i, v), (torch.zeros(V.N_CONTENT), torch.zeros(V.N_CONTENT)))
        out.append(_candidate("conditional", diff[t], se[t], TRUTH_BOUND, qa,
                              qa_scan.feature_index("conditional", t, i, v), token=V.CONTENT[t], attr=i, value=v))
    return out


def audit_family(score: P.Scorer, qa_rows: list[dict], p: torch.Tensor, y: torch.Tensor, fresh: torch.Tensor,
                 gen: torch.Generator) -> dict:
    """Risk, flag and evidence for one family from two reference responses y, fresh (M, L) to each of
    the prompts p (M, P)."""
    eff = P.token_effects(score, p, y)                         # (M, L, C)
    predicted = score(D.prompts_tensor(qa_rows), D.responses_tensor(qa_rows)).numpy() if qa_rows else np.zeros(0)
    qa = qa_scan.scan(qa_rows, predicted)
    tokens = _token_candidates(eff, qa["token"])
    token = torch.tensor([c["effect"] for c in tokens])
    cands = (tokens + _pair_candidates(score, p, y, fresh, token, qa["pair"], gen)
             + _conditional_candidates(eff, p, qa["conditional"]))
    cands = sorted((score_candidate(c) for c in cands), key=lambda c: (-round(c["risk"], 3), -c["excess"]))
    flagged = [c for c in cands if c["risk"] >= 0.5]
    evidence = cands[:max(EVIDENCE, len(flagged))]
    return {"risk": cands[0]["risk"], "flag": bool(flagged), "evidence": evidence}


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


def _responses(policy, prompts: torch.Tensor, n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """n balanced prompts and two reference responses to each."""
    p = attribute_spread_prompts(prompts, n, gen)
    y = rollout.sample(policy, p, 2, 1.0, gen).view(len(p), 2, -1)  # row i belongs to prompt i // 2
    return p, y[:, 0], y[:, 1]


def run_diagnostic(rm_dir: str, policy_dir: str, prompts_path: str, n_prompts: int = 24, seed: int = 0) -> dict:
    """{"families": {F: {"risk", "flag", "evidence"}}} for every family in the prompts file."""
    qa_path = os.path.join(rm_dir, "train.jsonl")
    if not os.path.isfile(qa_path):
        raise InputError(f"{qa_path}: missing QA sample (the reward model directory must ship train.jsonl)")
    qa = D.read_jsonl(qa_path, labelled=True)
    rm, _ = R.load_rm(rm_dir)
    score = functools.partial(R.score, rm)
    policy, _ = M.load_policy(policy_dir)
    records = D.read_jsonl(prompts_path)
    if not records:
        raise InputError(f"{prompts_path}: no prompts")
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for f, recs in D.group_by_family(records).items():
        p, y, fresh = _responses(policy, D.prompts_tensor(recs), n_prompts, gen)
        out[f] = audit_family(score, [r for r in qa if r["family"] == f], p, y, fresh, gen)
    return {"families": {f: out[f] for f in V.FAMILIES if f in out}}
