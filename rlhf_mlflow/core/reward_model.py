"""The reward model: a bidirectional tiny transformer over [prompt ; response], mean-pooled, scalar head.

Module names, state_dict keys and config.json keys match the seed's `rlhf/reward_model.py`.
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn

from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.checkpoint import load_weights, read_config, save_module
from rlhf_mlflow.core.files import atomic_dir
from rlhf_mlflow.core.label_head import LabelHead
from rlhf_mlflow.core.model import Trunk

CONFIG_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "seq_len")
WEIGHTS = "rm.safetensors"
REPAIR_REPORT = "repair.json"
"""What a repair measured, beside a repaired model's weights (training/repair_rm.py): a model that carries
one learnt from the expert set, among other labels."""
RL_CHUNK = 32  # sequences per pass in the RL step: activations stay in a core's L2 cache (~20% faster here)


def default_config() -> dict:
    return {"vocab_size": len(V.TOKENS), "d_model": 96, "n_layers": 2, "n_heads": 4, "d_ff": 192,
            "seq_len": V.SEQ_LEN}


class RewardModel(Trunk):
    def __init__(self, cfg: dict):
        super().__init__(cfg)
        d = cfg["d_model"]
        self.head = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, 1))
        self.label_head: LabelHead | None = None
        """A repaired model's label head (core/label_head.py; its own file, not in the state_dict)."""

    def forward(self, ids: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """ids (B, T) -> scalar reward (B,); bidirectional attention, mean-pooled, plus the label head
        where there is one.

        `table` is first_layer_table(), to look the first block up instead of running it per token.
        """
        if self.label_head is not None and not self.label_head.uses_trunk:
            return self.label_head.combine(ids, None)
        pooled = self.hidden(ids, causal=False, table=table).mean(1)  # (B, d)
        trunk = self.head(pooled).squeeze(-1)
        return trunk if self.label_head is None else self.label_head.combine(ids, trunk)


def save_rm(rm: RewardModel, cfg: dict, out_dir: str) -> None:
    """rm.safetensors + config.json (seed format) and, beside them, the label head if the model has one:
    the directory appears whole (replacing one that was there)."""
    if rm.label_head is None:
        save_module(rm, cfg, out_dir, WEIGHTS)
        return
    with atomic_dir(out_dir) as tmp:
        save_module(rm, cfg, tmp, WEIGHTS)
        rm.label_head.save(tmp)


def load_rm(ckpt_dir: str) -> tuple[RewardModel, dict]:
    """The reward model in `ckpt_dir`, with its label head when the directory holds one."""
    cfg = read_config(ckpt_dir, CONFIG_KEYS)
    rm = RewardModel(cfg)
    load_weights(rm, ckpt_dir, WEIGHTS)
    rm.label_head = LabelHead.load(ckpt_dir)
    return rm, cfg


@torch.inference_mode()
def score(rm: RewardModel, prompts_rep: torch.Tensor, responses: torch.Tensor, batch: int = 4096,
          table: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Reward-model scores (N,) of responses (N, L) given repeated prompts (N, P).

    `table` (rm.first_layer_table()) may be passed in by callers that score many batches with frozen weights.
    """
    if table is None:
        table = rm.first_layer_table()
    out = [rm(torch.cat([prompts_rep[i:i + batch], responses[i:i + batch]], 1), table)
           for i in range(0, prompts_rep.shape[0], batch)]
    return torch.cat(out) if out else torch.zeros(0)


def learnt_from_expert_set(ckpt_dir: str) -> bool:
    """A repaired reward model (it carries REPAIR_REPORT) learnt from the expert set, among other labels."""
    return os.path.isfile(os.path.join(ckpt_dir, REPAIR_REPORT))
