"""Best-of-n for the watch (decisions/bon_watch.py decides): n_max samples of the policy per expert
prompt, scored by the raw reward model (what best-of-n selects by) and corrected (what its estimate
uses), and the expert responses' corrected scores. The policy and the reward model are any
implementation of core/protocol.py."""
from __future__ import annotations

import torch

from rlhf_mlflow.core import protocol as P
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.own_models import as_policy, as_reward_model
from rlhf_mlflow.decisions import bon_watch as BW
from rlhf_mlflow.decisions import watch as W
from rlhf_mlflow.evidence.certify_evidence import scores


@torch.no_grad()
def bon_points(policy, rm, wrapper, gold: list[dict], ns: list[int], temperature: float = 1.0,
               cfg: W.WatchConfig = W.WatchConfig()) -> list[W.WatchPoint]:
    """One WatchPoint per n (its `step` is n): per family of the expert set, the direct estimate of
    best-of-n's true quality, its bootstrap draws, KL_n and the gain over the expert labels' mean."""
    if not ns or min(ns) < 1:
        raise ValueError(f"best-of-n needs n >= 1, got {ns}")
    policy, rm = as_policy(policy), as_reward_model(rm)
    by_family = D.group_by_family(gold)
    fams = [f for f in V.FAMILIES if f in by_family]
    rows = [r for f in fams for r in by_family[f]]
    prompts, n_max = D.prompts_tensor(rows), max(ns)
    samples = P.sample(policy, prompts, n_max, temperature, torch.Generator().manual_seed(cfg.seed))
    prompts_rep = prompts.repeat_interleave(n_max, 0)
    raw = P.score(rm, prompts_rep, samples).view(len(rows), n_max)
    corrected = scores(rm, wrapper, [r for r in rows for _ in range(n_max)], prompts_rep, samples)
    expert_scores = scores(rm, wrapper, rows, prompts, D.responses_tensor(rows))
    return BW.chosen_points(rows, fams, expert_scores, raw.numpy(), corrected.reshape(len(rows), n_max), ns, cfg)
