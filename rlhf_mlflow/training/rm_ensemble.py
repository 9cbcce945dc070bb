"""The members of a reward-model ensemble: where they disagree, the reward model does not know.

Each member is the parent fine-tuned (repair_rm.fine_tune: weighted MSE, the repair's epochs and learning
rate) on the repair's rows, with
  - a Poisson(1) bootstrap of the rows' weights (its own draw: each member sees the data differently), and
  - a scalar head initialised afresh from its own seed (a random prior: members that shared the parent's
    head agreed with each other even where the parent extrapolates, docs/REPAIR.md),
so the members agree where the labels pin the reward down and spread where they do not. The policy is
trained on their mean minus k x their standard deviation (core/reward_ensemble.penalised).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.training import repair_rm as RR

SEED_STRIDE = 1000
"""Member i trains with seed cfg.seed + SEED_STRIDE * (i + 1): apart from the repair's own seeds."""


def bootstrap_weights(weights: torch.Tensor, seed: int) -> torch.Tensor:
    """weights (N,) times Poisson(1) counts: a bootstrap resample, as weights."""
    gen = torch.Generator().manual_seed(seed)
    return weights * torch.poisson(torch.ones_like(weights), generator=gen)


def train_members(parent_dir: str, data: RR.RepairData, k: int, cfg: RR.RepairConfig,
                  on_member: Callable[[int], None] | None = None) -> list[R.RewardModel]:
    """k members fine-tuned from `parent_dir` on bootstraps of `data`, each with a new head."""
    members = []
    for i in range(k):
        if on_member is not None:
            on_member(i)
        seed = cfg.seed + SEED_STRIDE * (i + 1)
        members.append(RR.fine_tune(parent_dir, data.rows, bootstrap_weights(data.weights, seed),
                                    replace(cfg, seed=seed), new_head=True))
    return members


def ensemble_for_repair(parent_dir: str, crowd: list[dict], experts: list[dict], rules: list[dict],
                        cfg: RR.RepairConfig, anchors: list[dict] | None = None,
                        on_member: Callable[[int], None] | None = None) -> list[R.RewardModel]:
    """cfg.ensemble members on the repair's own data (the crowd without the rules' premiums, the anchors,
    every expert label): what `repair` trains its one model on. None (an empty list) when cfg.ensemble is 0."""
    if not cfg.ensemble:
        return []
    data = RR.RepairData.build(parent_dir, RR.remove_premiums(crowd, rules) + list(anchors or []), experts, cfg)
    return train_members(parent_dir, data, cfg.ensemble, cfg, on_member)
