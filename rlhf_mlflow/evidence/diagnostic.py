"""The diagnostic on live models (decisions/diagnostic.py decides): opens the reward model and the
reference policy (ours from their directories, or any implementation of core/protocol.py named by an
import path), draws two reference responses to each of a family's balanced probe prompts, and audits the
family with the reward model's `score`.

    python -m rlhf_mlflow.diagnostic --rm-dir D --policy-dir D --prompts F [--gold F] --out F
"""
from __future__ import annotations

import functools
import os

import torch

from rlhf_mlflow.core import protocol as P
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.own_models import open_policy, open_reward_model
from rlhf_mlflow.decisions import premium_test as PT
from rlhf_mlflow.decisions.diagnostic import N_PROMPTS, attribute_spread_prompts, audit_family


def probe_responses(policy: P.Policy, prompts: torch.Tensor, n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """n balanced prompts and two reference responses to each."""
    p = attribute_spread_prompts(prompts, n, gen)
    y = P.sample(policy, p, 2, 1.0, gen).view(len(p), 2, -1)  # row i belongs to prompt i // 2
    return p, y[:, 0], y[:, 1]


def _labelled(path: str, what: str, scale: str) -> list[dict]:
    if not os.path.isfile(path):
        raise InputError(f"{path}: missing {what}")
    return D.read_jsonl(path, labelled=True, scale=scale)


def run_diagnostic(rm_dir: str, policy_dir: str, prompts_path: str, n_prompts: int = N_PROMPTS, seed: int = 0,
                   gold_path: str | None = None, policy_impl: str | None = None, reward_impl: str | None = None,
                   qa_path: str | None = None) -> dict:
    """{"families": {F: {"risk", "flag", "evidence"}}} for every family in the prompts file.
    `gold_path` (optional) is an expert set: labelled reference samples (data/gold_calib.jsonl).
    `policy_impl` / `reward_impl` (import paths 'package.module:factory', called with `policy_dir` /
    `rm_dir`) open another implementation (core/protocol.py); `qa_path`: the vendor's QA sample (default:
    the reward model directory's train.jsonl)."""
    qa = _labelled(qa_path or os.path.join(rm_dir, "train.jsonl"),
                   "QA sample (the reward model directory must ship train.jsonl)", D.CROWD)
    gold = _labelled(gold_path, "expert set", D.EXPERT) if gold_path else None
    score = functools.partial(P.score, open_reward_model(rm_dir, reward_impl))
    policy = open_policy(policy_dir, policy_impl)
    records = D.read_jsonl(prompts_path)
    if not records:
        raise InputError(f"{prompts_path}: no prompts")
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for f, recs in D.group_by_family(records).items():
        p, y, fresh = probe_responses(policy, D.prompts_tensor(recs), n_prompts, gen)
        in_family = [r for r in gold if r["family"] == f] if gold is not None else None
        out[f] = audit_family(score, [r for r in qa if r["family"] == f], p, y, fresh, gen, in_family)
    return {"families": {f: out[f] for f in V.FAMILIES if f in out}, "alpha": PT.ALPHA,
            "min_premium": PT.MIN_PREMIUM, "expert_set": bool(gold_path)}
