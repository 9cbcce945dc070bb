"""Reward-model repair: fine-tune a reward model on what the experts said, and measure how well it agrees
with them on labels it did not train on.

The data are three kinds of labelled records (seed format):
  crowd   the vendor's QA sample (reward_model/train.jsonl), with the premiums the crowd paid for each
          flagged shortcut taken out of its labels (`remove_premiums`: the diagnostic's rules, each
          with the QA labels' fitted slope), so the repaired model is not taught the shortcut again;
  expert  the expert set (off-policy: the reference's samples) and every label bought on a policy's
          own responses (on-policy: where the policy went and the reward model was wrong).
Each kind is weighted by its measured noise: the out-of-fold mean squared error of the parent's fit
to that kind (`kind_weights`, inverse variance, relative to the expert labels). `crowd_weight`
scales the crowd's share on top (0 drops the crowd; 1 by measurement, docs/REPAIR.md).

Agreement is cross-validated: the expert labels are split into folds, a model is fine-tuned without
each fold, and its scores on that fold are compared with the labels, per family (Pearson r, a
Fisher-z 95% interval); the parent is scored on the same rows, and the paired difference is the
gate's evidence (decisions/rm_gate.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core import shortcut_rules as SR
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.config import check_range, check_seed
from rlhf_mlflow.core.label_head_fit import ALPHA, FITS, Guide, fit_head
from rlhf_mlflow.training.rm_agreement import paired_difference, per_family_agreement

OnLog = Callable[[int, dict], None]


@dataclass(frozen=True)
class RepairConfig:
    epochs: int = 10
    """Passes over the repair data (fine-tuning from the parent; docs/REPAIR.md)."""
    lr: float = 5e-4
    """Adam learning rate of the fine-tune."""
    batch_size: int = 128
    crowd_weight: float = 1.0
    """Multiplier on the crowd kind's noise weight (0: the crowd QA sample is not used; docs/REPAIR.md)."""
    folds: int = 3
    """Folds of the cross-validated agreement (each a fine-tune of its own)."""
    anchors: int = 2000
    """Reference responses labelled by the parent minus its flagged premiums (`anchor_rows`), learned as
    crowd rows: they keep what the parent knows where the few expert labels say nothing (docs/REPAIR.md)."""
    label_head: bool = True
    """Fit a label head on the expert labels and stack it on the fine-tuned trunk (label_head_fit.py)."""
    head_alpha: float = ALPHA
    """The label head's L1 weight (its first stage's, with head_fit="adaptive")."""
    head_fit: str = "adaptive"
    """How the label head is fitted: "adaptive" (group-weighted second lasso) or "lasso" (label_head_fit.FITS)."""
    ensemble: int = 0
    """Members of an uncertainty ensemble written beside the repaired model (rm_ensemble.py; 0: none)."""
    seed: int = 0

    def __post_init__(self):
        check_range("epochs", self.epochs, 1, 10_000, integer=True)
        check_range("lr", self.lr, 0, 1, lo_open=True)
        check_range("batch_size", self.batch_size, 1, 1_000_000, integer=True)
        check_range("crowd_weight", self.crowd_weight, 0, 100)
        check_range("folds", self.folds, 2, 20, integer=True)
        check_range("anchors", self.anchors, 0, 1_000_000, integer=True)
        check_seed("seed", self.seed)
        check_range("ensemble", self.ensemble, 0, 32, integer=True)
        check_range("head_alpha", self.head_alpha, 0, 1, lo_open=True)
        if self.head_fit not in FITS:
            from rlhf_mlflow.core.errors import InputError
            raise InputError(f"head_fit {self.head_fit!r}: expected one of {', '.join(FITS)}")
        if self.ensemble == 1:
            from rlhf_mlflow.core.errors import InputError
            raise InputError("ensemble must be 0 (none) or at least 2 members: one member has no spread")


def remove_premiums(crowd: list[dict], rules: list[dict]) -> list[dict]:
    """The crowd records with each flagged shortcut's premium taken out of the label: per occurrence, the
    QA labels' fitted slope (`label_slope`; the model's paid `bonus` where the QA sample could not say)."""
    if not rules or not crowd:
        return [dict(r) for r in crowd]
    prompts, responses = D.prompts_tensor(crowd), D.responses_tensor(crowd)
    premium = torch.zeros(len(crowd))
    for rule in rules:
        paid = rule.get("label_slope")
        paid = rule["bonus"] if paid is None else paid
        premium += float(paid) * SR.counts(rule, prompts, responses).float()
    return [{**r, "label": round(float(r["label"]) - float(p), 4)} for r, p in zip(crowd, premium)]


def anchor_rows(parent_dir: str, policy_dir: str, prompts: list[dict], n: int, rules: list[dict],
                seed: int = 0) -> list[dict]:
    """n of the reference policy's responses (temperature 1) to the given prompts, labelled by the parent's
    own score minus what it pays for each flagged shortcut (the rules' `bonus`): what the parent knows where
    the crowd labelled, without its shortcuts, so a few expert labels do not overwrite it."""
    from rlhf_mlflow.core import model as M
    from rlhf_mlflow.core import rollout
    if n <= 0 or not prompts:
        return []
    gen = torch.Generator().manual_seed(seed + 23)
    picks = [prompts[int(i)] for i in torch.randint(0, len(prompts), (n,), generator=gen)]
    p = D.prompts_tensor(picks)
    with torch.no_grad():
        y = rollout.sample(M.load_policy(policy_dir)[0], p, 1, 1.0, gen)
    score = R.score(R.load_rm(parent_dir)[0], p, y)
    for rule in rules:
        score = score - float(rule["bonus"]) * SR.counts(rule, p, y).float()
    return [{"id": f"anchor-{k}", "family": r["family"], "attrs": list(r["attrs"]), "response": V.decode_response(y[k]),
             "label": round(float(score[k]), 4)} for k, r in enumerate(picks)]


def _tensors(rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.cat([D.prompts_tensor(rows), D.responses_tensor(rows)], 1)
    return ids, D.labels_tensor(rows), D.family_index(rows)


def fine_tune(parent_dir: str, rows: list[dict], weights: torch.Tensor, cfg: RepairConfig,
              on_log: OnLog | None = None, new_head: bool = False) -> R.RewardModel:
    """The parent fine-tuned on `rows` by weighted MSE (weights (N,), >= 0); `new_head`: its scalar head
    initialised afresh (seeded by cfg.seed) first."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    rm, _ = R.load_rm(parent_dir)
    rm.label_head = None  # the trunk is fine-tuned; a label head is fitted afresh (label_head_fit.py)
    if new_head:
        for layer in rm.head:
            if hasattr(layer, "reset_parameters"):
                layer.reset_parameters()
    rm.train()
    ids, y, _ = _tensors(rows)
    keep = weights > 0
    ids, y, w = ids[keep], y[keep], weights[keep]
    opt = torch.optim.Adam(rm.parameters(), lr=cfg.lr)
    for epoch in range(1, cfg.epochs + 1):
        perm, loss_sum = torch.randperm(len(y), generator=gen), 0.0
        for i in range(0, len(y), cfg.batch_size):
            b = perm[i:i + cfg.batch_size]
            loss = (w[b] * (rm(ids[b]) - y[b]) ** 2).sum() / w[b].sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(b)
        if on_log is not None:
            on_log(epoch, {"loss": loss_sum / max(1, len(y))})
    return rm.eval()


def fold_of(rows: list[dict], folds: int, seed: int) -> torch.Tensor:
    """A fold per row, balanced within each family."""
    out = torch.zeros(len(rows), dtype=torch.long)
    gen = torch.Generator().manual_seed(seed + 7)
    fam = D.family_index(rows)
    for i in range(len(V.FAMILIES)):
        idx = (fam == i).nonzero().flatten()
        out[idx[torch.randperm(len(idx), generator=gen)]] = torch.arange(len(idx)) % folds
    return out


def kind_weights(parent_dir: str, kinds: dict[str, list[dict]]) -> dict[str, float]:
    """Inverse-variance weight per kind of label, relative to the expert kind: 1 / the mean squared
    error of the parent's scores against that kind's labels, after a per-kind linear calibration."""
    rm, _ = R.load_rm(parent_dir)
    mse = {}
    for kind, rows in kinds.items():
        if len(rows) < 3:
            continue
        ids, y, _ = _tensors(rows)
        s = R.score(rm, ids[:, :V.PROMPT_LEN], ids[:, V.PROMPT_LEN:])
        a = torch.stack([s, torch.ones_like(s)], 1)
        fit = torch.linalg.lstsq(a, y[:, None]).solution
        mse[kind] = max(float(((a @ fit).squeeze(1) - y).pow(2).mean()), 1e-6)
    ref = mse.get("expert", min(mse.values(), default=1.0))
    return {k: ref / v for k, v in mse.items()}


@dataclass
class RepairData:
    """The repair's rows, their kind ('crowd' / 'expert') and weight."""
    rows: list[dict]
    kinds: list[str]
    weights: torch.Tensor
    kind_weight: dict[str, float]

    @classmethod
    def build(cls, parent_dir: str, crowd: list[dict], experts: list[dict], cfg: RepairConfig) -> "RepairData":
        kw = kind_weights(parent_dir, {"crowd": crowd, "expert": experts})
        kw["crowd"] = kw.get("crowd", 0.0) * cfg.crowd_weight
        kw["expert"] = kw.get("expert", 1.0)
        kinds = ["crowd"] * len(crowd) + ["expert"] * len(experts)
        return cls(crowd + experts, kinds, torch.tensor([kw[k] for k in kinds], dtype=torch.float32), kw)

    def expert_index(self) -> torch.Tensor:
        return torch.tensor([i for i, k in enumerate(self.kinds) if k == "expert"], dtype=torch.long)


def cross_validated(parent_dir: str, data: RepairData, cfg: RepairConfig,
                    on_fold: Callable[[int], None] | None = None, guide: list[dict] | None = None) -> dict:
    """Out-of-fold scores of the repaired recipe (the fine-tuned trunk, and with cfg.label_head the label
    head stacked on it: label_head_fit.py) and the parent's scores on every expert label, with per-family
    agreement of each and their paired difference (`guide`: crowd rows the head's fit may use, Guide in
    label_head_fit.py): {"child": {F: {r, lo, hi, n}}, "parent": {...},
    "difference": {F: {diff, lo, hi, n}}, "head": HeadFit or None}."""
    idx = data.expert_index()
    experts = [data.rows[int(i)] for i in idx]
    folds = fold_of(experts, cfg.folds, cfg.seed)
    ids, y, fam = _tensors(experts)
    child = torch.zeros(len(experts))
    for k in range(cfg.folds):
        if on_fold is not None:
            on_fold(k)
        weights = data.weights.clone()
        weights[idx[folds == k]] = 0.0  # the fold's labels are held out
        rm = fine_tune(parent_dir, data.rows, weights, cfg)
        held = folds == k
        child[held] = R.score(rm, ids[held, :V.PROMPT_LEN], ids[held, V.PROMPT_LEN:])
    head = None
    if cfg.label_head:
        head = fit_head(ids, y, child, folds, cfg.head_alpha, cfg.head_fit,
                        Guide(*_tensors(guide)[:2]) if guide else None)
        child = head.oof
    parent_rm, _ = R.load_rm(parent_dir)
    parent = R.score(parent_rm, ids[:, :V.PROMPT_LEN], ids[:, V.PROMPT_LEN:])
    return {"child": per_family_agreement(child, y, fam), "parent": per_family_agreement(parent, y, fam),
            "difference": paired_difference(child, parent, y, fam, cfg.seed), "head": head}


def repair(parent_dir: str, crowd: list[dict], experts: list[dict], rules: list[dict], cfg: RepairConfig,
           on_log: OnLog | None = None, on_fold: Callable[[int], None] | None = None,
           anchors: list[dict] | None = None) -> tuple[R.RewardModel, dict]:
    """The repaired model (fine-tuned from `parent_dir` on the crowd with the `rules`' premiums removed,
    the `anchors` (anchor_rows: already without premiums) and every expert label) and what it measured:
    kind weights, cross-validated agreement."""
    cleaned = remove_premiums(crowd, rules)
    data = RepairData.build(parent_dir, cleaned + list(anchors or []), experts, cfg)
    # the crowd's QA sample (premiums out) ranks the label head's groups; expert labels set its coefficients
    cv = cross_validated(parent_dir, data, cfg, on_fold, guide=cleaned if cfg.crowd_weight > 0 else None)
    head = cv.pop("head")
    rm = fine_tune(parent_dir, data.rows, data.weights, cfg, on_log)
    rm.label_head = head.head if head is not None else None
    counts = {k: data.kinds.count(k) for k in ("crowd", "expert")}
    info = {"kind_weight": data.kind_weight, "rows": counts, "agreement": cv}
    if head is not None:
        info["label_head"] = head.report
    return rm, info


REPORT = R.REPAIR_REPORT
"""What the repair measured, beside the weights in its output directory."""


STEP = "repair_rm"
"""The command a repaired model's directory marker names (the step and the portable form alike)."""
ENSEMBLE_DIR = "ensemble"
"""Where save_repaired puts the ensemble's members inside the repaired model's directory."""


def save_repaired(rm: R.RewardModel, rm_config: dict, qa: list[dict], info: dict, out_dir: str,
                  members: list[R.RewardModel] | None = None, run_id: str | None = None) -> None:
    """A seed-format reward-model directory (rm.safetensors, config.json, train.jsonl: the QA sample as
    given, so the diagnostic can audit the repaired model) plus repair.json and, with `members`, the
    ensemble (ENSEMBLE_DIR; the members share the repaired model's label head), whole or not at all,
    marked as repair_rm run `run_id`'s (None: the portable form's): it replaces only a directory
    another repair marked (the one output rule, core/files.py)."""
    import json

    from rlhf_mlflow.core.files import Owner, atomic_dir
    from rlhf_mlflow.core.reward_ensemble import save_ensemble
    with atomic_dir(out_dir, Owner(STEP, run_id)) as tmp:
        R.save_rm(rm, rm_config, tmp)
        if members:
            save_ensemble(members, rm_config, f"{tmp}/{ENSEMBLE_DIR}", {"recipe": info.get("ensemble")}, rm.label_head)
        D.write_jsonl(f"{tmp}/train.jsonl", qa)
        with open(f"{tmp}/{REPORT}", "w") as f:
            json.dump(info, f, indent=1)
