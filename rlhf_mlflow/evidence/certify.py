"""certify() on live models: opens the policy, the reference and the reward model (ours from their
directories, or any implementation of core/protocol.py named by an import path), gathers each family's
evidence (certify_evidence.py) and hands the arrays to decisions/certify.py's estimators; the report
records its inputs, their sha256 and the rules, so that release can recompute it.

    python -m rlhf_mlflow.certify --policy D --reference D --gold F --out F [--rm-dir D] [--policy-impl M:F]
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, replace

import torch

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core import shortcut_rules as SR
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.checkpoint import content_sha256
from rlhf_mlflow.core.errors import InputError
from rlhf_mlflow.core.own_models import open_policy, open_reward_model
from rlhf_mlflow.core.reward_wrapper import RewardWrapper, load_wrapper
from rlhf_mlflow.decisions.certify import ESTIMATOR_VERSION, CertifyConfig, aggregate, estimate_families
from rlhf_mlflow.decisions.label_requests import read_labels
from rlhf_mlflow.evidence.certify_evidence import family_evidence, labelled_scores

IMPLS = ("policy_impl", "reward_impl")
"""Report inputs that name an implementation (an import path), not a file: recorded only when given."""


def config_for(cfg: CertifyConfig, rm_dir: str | None) -> CertifyConfig:
    """`cfg` as certify applies it with the reward model in `rm_dir`: without off-policy evidence when
    that model learnt from the expert set (R.learnt_from_expert_set)."""
    if rm_dir and cfg.off_policy and R.learnt_from_expert_set(rm_dir):
        return replace(cfg, off_policy=False)
    return cfg


def certify(policy_dir: str, reference_dir: str, gold_path: str, *, rm_dir: str | None = None,
            correction: str | RewardWrapper | None = None, diagnostic: str | dict | None = None,
            pilot_prompts: str | None = None, cfg: CertifyConfig = CertifyConfig(),
            shortcuts: list[dict] | None = None, policy_labels: str | None = None,
            policy_impl: str | None = None, reward_impl: str | None = None) -> dict:
    """Certify `policy_dir` against `reference_dir` with the expert set at `gold_path`.

    `rm_dir` enables the direct and doubly-robust estimates; `correction` is a reward-wrapper file
    (from `rlhf_mlflow.correction`), or one already loaded, applied to the reward model's scores;
    `diagnostic` (evidence JSON, path or dict) adds the flagged shortcuts' counts under the policy and
    the reference (`shortcuts`, the flagged rules themselves, instead: how a report is recomputed; with
    neither, the report's `shortcut_rules` is null: no shortcut was looked for);
    `pilot_prompts` adds the `pilot` aggregate weighted by that file's family mix; `policy_labels` (a
    JSONL file of the policy's own responses labelled by the expert, see label_requests.py) certifies
    the families that have enough of them by PPI (labelled.py). `policy_impl` / `reward_impl` (import
    paths 'package.module:factory', called with `policy_dir` / `rm_dir`) open a policy or reward model
    of another implementation (core/protocol.py); default: ours."""
    gold = D.read_jsonl(gold_path, labelled=True, scale=D.EXPERT)
    cfg = config_for(cfg, rm_dir)
    policy = open_policy(policy_dir, policy_impl)
    reference = open_policy(reference_dir)
    rm = open_reward_model(rm_dir, reward_impl) if rm_dir else None
    wrapper = correction if isinstance(correction, RewardWrapper) else load_wrapper(correction)
    # None: no diagnostic was given, so nobody looked for shortcuts (marker_collapse is then unknown);
    # []: a diagnostic flagged none
    if shortcuts is None and diagnostic is not None:
        shortcuts = SR.flagged_from(diagnostic)
    gen = torch.Generator().manual_seed(cfg.seed)
    by_family = D.group_by_family(gold)
    labelled = D.group_by_family(read_labels(policy_labels)) if policy_labels else {}
    evidence = {}
    for f in V.FAMILIES:
        if f not in by_family:
            continue
        if len(by_family[f]) < 10:
            raise InputError(f"{gold_path}: family {f} has {len(by_family[f])} expert rows; certification needs >= 10")
        evidence[f] = family_evidence(policy, reference, rm, wrapper, by_family[f], cfg, shortcuts or [], gen)
    rows, draws, ref_draws = estimate_families(evidence, labelled, labelled_scores(rm, wrapper, labelled), cfg)
    inputs = {"policy": policy_dir, "reference": reference_dir, "gold": gold_path, "rm_dir": rm_dir,
              "correction": wrapper.path if wrapper else None, "pilot_prompts": pilot_prompts,
              "policy_labels": policy_labels, **{k: v for k, v in zip(IMPLS, (policy_impl, reward_impl)) if v}}
    report = {"estimator": ESTIMATOR_VERSION, "families": rows,
              "balanced": aggregate(rows, draws, ref_draws, {f: 1.0 for f in V.FAMILIES}, cfg),
              "config": asdict(cfg), "inputs": inputs, "shortcut_rules": shortcuts}
    report["input_sha256"] = {k: content_sha256(v) for k, v in inputs.items() if v and k not in ("policy", *IMPLS)}
    if wrapper:  # the bytes it executed, which the file may no longer hold
        report["input_sha256"]["correction"] = wrapper.sha256
    if pilot_prompts:
        mix = Counter(r["family"] for r in D.read_jsonl(pilot_prompts))
        report["pilot"] = aggregate(rows, draws, ref_draws, dict(mix), cfg)
    return report
