"""Reward-model training: MSE regression of labels on [prompt ; response] (the seed's recipe)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.config import check_range, check_seed

log = logging.getLogger(__name__)
OnLog = Callable[[int, dict], None]


@dataclass(frozen=True)
class RMConfig:
    epochs: int = 40
    """Passes over the labelled records (seed: 40)."""
    lr: float = 2e-3
    """Adam learning rate (seed: 2e-3)."""
    batch_size: int = 128
    """Records per optimiser step."""
    lr_schedule: str = "constant"
    """'constant' (the seed's) or 'cosine' (decays to 10% of lr over the run)."""
    seed: int = 0
    """Seed for initialisation and shuffling."""

    def __post_init__(self):
        check_range("epochs", self.epochs, 1, 10_000, integer=True)
        check_range("lr", self.lr, 0, 1, lo_open=True)
        check_range("batch_size", self.batch_size, 1, 1_000_000, integer=True)
        check_seed("seed", self.seed)
        if self.lr_schedule not in ("constant", "cosine"):
            from rlhf_mlflow.core.errors import InputError
            raise InputError(f"lr_schedule must be one of ['constant', 'cosine'], got {self.lr_schedule!r}")


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    if x.numel() < 2 or float(x.std()) == 0 or float(y.std()) == 0:
        return float("nan")
    return float(torch.corrcoef(torch.stack([x.float(), y.float()]))[0, 1])


def per_family_fit(scores: torch.Tensor, labels: torch.Tensor, fam_idx: torch.Tensor) -> dict[str, dict]:
    """Per family: Pearson r and MSE of scores against labels."""
    out = {}
    for i, f in enumerate(V.FAMILIES):
        m = fam_idx == i
        if int(m.sum()) >= 2:
            out[f] = {"pearson": pearson(scores[m], labels[m]), "mse": float(((scores[m] - labels[m]) ** 2).mean()),
                      "n": int(m.sum())}
    return out


def train_rm(records: list[dict], cfg: RMConfig = RMConfig(), on_log: OnLog | None = None,
             log_every: int = 1) -> tuple[R.RewardModel, dict]:
    """Train a reward model on labelled records; returns (model, per-family fit statistics).

    on_log(epoch, {"loss": ..}) is called every `log_every` epochs.
    """
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    ids = torch.cat([D.prompts_tensor(records), D.responses_tensor(records)], 1)  # (N, T)
    labels = D.labels_tensor(records)
    rm_cfg = R.default_config()
    rm = R.RewardModel(rm_cfg)
    rm.train()
    opt = torch.optim.Adam(rm.parameters(), lr=cfg.lr)
    N = ids.shape[0]
    steps_per_epoch = (N + cfg.batch_size - 1) // cfg.batch_size
    total = cfg.epochs * steps_per_epoch
    sched = None
    if cfg.lr_schedule == "cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, total, eta_min=cfg.lr * 0.1)
    for epoch in range(1, cfg.epochs + 1):
        perm = torch.randperm(N, generator=gen)
        loss_sum = 0.0
        for i in range(0, N, cfg.batch_size):
            b = perm[i:i + cfg.batch_size]
            loss = ((rm(ids[b]) - labels[b]) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if sched is not None:
                sched.step()
            loss_sum += loss.item() * len(b)
        if on_log is not None and (epoch % log_every == 0 or epoch == cfg.epochs):
            on_log(epoch, {"loss": loss_sum / N})
    rm.eval()
    scores = R.score(rm, ids[:, :V.PROMPT_LEN], ids[:, V.PROMPT_LEN:])
    fit = per_family_fit(scores, labels, D.family_index(records))
    return rm, {"config": rm_cfg, "fit": fit}
