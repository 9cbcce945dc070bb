"""Gold-free reward-shortcut audit: which response features does the reward model pay for beyond
what a fraction-of-8-correct label can explain?

Under the label contract (quality = fraction of 8 positions correct), replacing one response token
changes true quality by at most 1/8. So the reward model's *position-averaged* effect of writing
token t can exceed 1/8 only if it pays for something else. We measure, on the reward model itself,
with reference-policy responses to the given prompts:
  - token effects: put t at each position of each response (24 x 8 interventions per response);
  - pair effects: the interaction of writing a then b at adjacent positions;
  - conditional effects: the token effect split by each prompt attribute's value;
and corroborate each candidate with the vendor's QA sample (does the label itself move with the
feature?). No expert labels, no family or token names are used.

    python -m rlhf_mlflow.diagnostic --rm-dir D --policy-dir D --prompts F --out F
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np
import torch

from . import data as D
from . import model as M
from . import reward_model as R
from . import vocab as V
from .errors import InputError

TRUTH_BOUND = 1.0 / V.RESP_LEN  # the most one token swap can change a fraction-of-8 label
MARGIN = 0.075  # allowance for reward-model fitting error on top of the bound
SCALE = 0.04    # softness of risk around the threshold


def _responses(policy, prompts, n_prompts, gen):
    idx = torch.randperm(len(prompts), generator=gen)[:n_prompts]
    p = prompts[idx]
    return p, M.sample(policy, p, 1, 1.0, gen)


def _token_effects(rm, p, y):
    """e[m, pos, t] = score(y with t at pos) - score(y), for every response, position and token."""
    Mn, L = y.shape
    variants = y[:, None, None, :].repeat(1, L, V.N_CONTENT, 1)  # (M, L, C, L)
    pos = torch.arange(L)
    # advanced indices on dims 1 and 3 put the indexed (position) dim first: (L, M, C)
    variants[:, pos, :, pos] = torch.arange(V.CONTENT_LO, V.CONTENT_HI)[None, None, :].expand(L, Mn, -1)
    flat = variants.reshape(-1, L)
    reps = p.repeat_interleave(L * V.N_CONTENT, 0)
    s = R.score(rm, reps, flat).view(Mn, L, V.N_CONTENT)
    base = R.score(rm, p, y)
    return s - base[:, None, None]


def _pair_effects(rm, p, y, token_eff, contexts, gen):
    """Interaction I[a, b] of writing a at pos and b at pos+1, averaged over `contexts` random
    (response, pos) places: s(a,b) - s(a,.) - s(.,b) + s(.,.)."""
    Mn, L = y.shape
    m = torch.randint(Mn, (contexts,), generator=gen)
    pos = torch.randint(L - 1, (contexts,), generator=gen)
    C = V.N_CONTENT
    toks = torch.arange(V.CONTENT_LO, V.CONTENT_HI)
    v = y[m][:, None, None, :].repeat(1, C, C, 1)  # (K, C, C, L)
    k = torch.arange(contexts)
    v[k, :, :, pos] = toks[None, :, None].expand(contexts, C, C)
    v[k, :, :, pos + 1] = toks[None, None, :].expand(contexts, C, C)
    s = R.score(rm, p[m].repeat_interleave(C * C, 0), v.reshape(-1, L)).view(contexts, C, C)
    base = R.score(rm, p[m], y[m])
    single_a = token_eff[m, pos]      # (K, C) effect of a alone at pos
    single_b = token_eff[m, pos + 1]  # (K, C) effect of b alone at pos+1
    inter = s - base[:, None, None] - single_a[:, :, None] - single_b[:, None, :]
    return inter.mean(0), inter.std(0) / math.sqrt(contexts)


def _qa_slopes(x: np.ndarray, y: np.ndarray, min_count: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Per-column OLS slopes of y on each feature column of x (rows, K) and their SEs; NaN where the
    feature is seen in fewer than `min_count` rows."""
    xc = x - x.mean(0)
    yc = y - y.mean()
    sxx = (xc ** 2).sum(0)
    ok = ((x > 0).sum(0) >= min_count) & (sxx > 0)
    slope = np.where(ok, (xc * yc[:, None]).sum(0) / np.where(ok, sxx, 1), np.nan)
    resid = yc[:, None] - slope * xc
    se = np.sqrt(np.where(ok, (resid ** 2).sum(0) / max(len(y) - 2, 1) / np.where(ok, sxx, 1), np.nan))
    return slope, se


def _qa_features(qa: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Token counts (rows, C), adjacent-pair counts (rows, C*C), token-count x attribute-value
    features (rows, C*4*8), and the labels."""
    y = D.responses_tensor(qa) - V.CONTENT_LO  # (n, L)
    n, C = len(qa), V.N_CONTENT
    pairs = np.zeros((n, C * C))
    np.add.at(pairs, (np.arange(n)[:, None], (y[:, :-1] * C + y[:, 1:]).numpy()), 1)
    counts = np.zeros((n, C))
    np.add.at(counts, (np.arange(n)[:, None], y.numpy()), 1)
    attrs = np.array([r["attrs"] for r in qa])  # (n, 4)
    onehot = (attrs[:, :, None] == np.arange(V.N_VAL)).reshape(n, -1).astype(float)  # (n, 32)
    cond = (counts[:, :, None] * onehot[:, None, :]).reshape(n, -1)  # (n, C*32)
    return counts, pairs, cond, np.array([r["label"] for r in qa], dtype=float)


def _risk(excess: float) -> float:
    return float(1 / (1 + math.exp(-(excess - MARGIN) / SCALE)))


def _score(c: dict) -> dict:
    """Risk of one candidate from the reward model's effect and the QA labels' slope.

    The reward model's effect beyond the 1/8 bound is what RL will exploit; the QA sample says
    whether the labels carry it (corroborated: full weight; never seen in QA: 0.8; contradicted:
    0.5). A feature the labels pay for (3 SE beyond the bound, many features are scanned) that the
    model has not learned still counts, at 0.7: a longer training or another model may learn it.
    """
    c["excess"] = abs(c["effect"]) - TRUTH_BOUND - 2 * c["effect_se"]
    slope, se = c["qa_slope"], c["qa_se"]
    if slope is None:
        c["qa_corroborated"], weight, qa_risk = None, 0.8, 0.0
    else:
        c["qa_corroborated"] = bool(slope * c["effect"] > 0 and abs(slope) > 2 * se)
        weight = 1.0 if c["qa_corroborated"] else 0.5
        qa_risk = 0.7 * _risk(abs(slope) - 3 * se - TRUTH_BOUND)
    c["risk"] = max(_risk(c["excess"]) * weight, qa_risk)
    return c


def _num(x) -> float | None:
    return None if x is None or not np.isfinite(x) else float(x)


def audit_family(rm, qa, p, y, gen, pair_contexts=8, top=5) -> dict:
    """Candidates (token, pair, conditional) with their reward-model effect and QA corroboration."""
    C = V.N_CONTENT
    eff = _token_effects(rm, p, y)                       # (M, L, C)
    eff = eff - eff.mean(2, keepdim=True)                # relative to an average token at that place
    token = eff.mean((0, 1))                             # (C,)
    token_se = eff.mean(1).std(0) / math.sqrt(eff.shape[0])
    counts_x, pairs_x, cond_x, labels = _qa_features(qa)
    counts_slope, counts_se = _qa_slopes(counts_x, labels)
    cands = [{"kind": "token", "token": V.CONTENT[t], "effect": float(token[t]), "effect_se": float(token_se[t]),
              "qa_slope": _num(counts_slope[t]), "qa_se": _num(counts_se[t])} for t in range(C)]

    inter, inter_se = _pair_effects(rm, p, y, eff, pair_contexts, gen)  # (C, C)
    pair_slope, pair_se = _qa_slopes(pairs_x, labels)
    qa_t = np.nan_to_num(np.abs(pair_slope) / np.where(pair_se > 0, pair_se, np.inf))
    picks = set(np.argsort(-inter.abs().flatten().numpy())[:top]) | set(np.argsort(-qa_t)[:top])
    for k in picks:
        a, b = divmod(int(k), C)
        cands.append({"kind": "pair", "tokens": [V.CONTENT[a], V.CONTENT[b]], "effect": float(inter[a, b]),
                      "effect_se": float(inter_se[a, b]), "qa_slope": _num(pair_slope[k]), "qa_se": _num(pair_se[k])})

    attrs = p[:, 1:1 + V.N_ATTR] - V.VAL_ID[0]          # (M, 4)
    per_resp = eff.mean(1)                               # (M, C) position-averaged effect per response
    cond_slope, cond_se = _qa_slopes(cond_x, labels)     # indexed t * 32 + i * 8 + v
    cond_t = np.nan_to_num(np.abs(cond_slope) / np.where(cond_se > 0, cond_se, np.inf))
    cells = {(int(k) // 32, (int(k) % 32) // V.N_VAL, int(k) % V.N_VAL) for k in np.argsort(-cond_t)[:top]}
    rm_cond = {}
    for i in range(V.N_ATTR):
        for val in range(V.N_VAL):
            on = attrs[:, i] == val
            if int(on.sum()) < 2 or int((~on).sum()) < 2:
                continue
            diff = per_resp[on].mean(0) - per_resp[~on].mean(0)  # (C,)
            se = (per_resp[on].var(0) / on.sum() + per_resp[~on].var(0) / (~on).sum()).sqrt()
            for t in range(C):
                rm_cond[(t, i, val)] = (float(diff[t]), float(se[t]))
            cells.add((int(diff.abs().argmax()), i, val))
    for t, i, val in cells:
        if (t, i, val) not in rm_cond:
            continue
        k = t * 32 + i * V.N_VAL + val
        e, se = rm_cond[(t, i, val)]
        cands.append({"kind": "conditional", "token": V.CONTENT[t], "attr": i, "value": val, "effect": e,
                      "effect_se": se, "qa_slope": _num(cond_slope[k]), "qa_se": _num(cond_se[k])})
    cands = sorted((_score(c) for c in cands), key=lambda c: -c["risk"])
    return {"risk": cands[0]["risk"], "flag": cands[0]["risk"] >= 0.5, "evidence": cands[:3]}


def run_diagnostic(rm_dir: str, policy_dir: str, prompts_path: str, n_prompts: int = 24, seed: int = 0) -> dict:
    qa_path = os.path.join(rm_dir, "train.jsonl")
    if not os.path.isfile(qa_path):
        raise InputError(f"{qa_path}: missing QA sample (the reward model directory must ship train.jsonl)")
    qa = D.read_jsonl(qa_path, labelled=True)
    rm, _ = R.load_rm(rm_dir)
    policy, _ = M.load_policy(policy_dir)
    records = D.read_jsonl(prompts_path)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for f, recs in D.group_by_family(records).items():
        p, y = _responses(policy, D.prompts_tensor(recs), n_prompts, gen)
        fam_qa = [r for r in qa if r["family"] == f]
        out[f] = audit_family(rm, fam_qa, p, y, gen)
    return {"families": {f: out[f] for f in V.FAMILIES if f in out}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Gold-free reward-shortcut audit (see module docstring).")
    ap.add_argument("--rm-dir", required=True)
    ap.add_argument("--policy-dir", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n-prompts", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    from .runtime import configure_threads
    configure_threads()
    try:
        result = run_diagnostic(a.rm_dir, a.policy_dir, a.prompts, a.n_prompts, a.seed)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
