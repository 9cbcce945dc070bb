"""The over-optimisation watch on live models (decisions/watch.py decides): `PolicyWatch` draws the
reference's part of the evidence once (the expert responses' reference log-probs and scores, the flagged
shortcuts' reference counts) and, at each watch point, the policy's (its own samples, their log-ratios
and scores), with the same seeds at every point. The reference, the policy and the reward model are any
implementation of core/protocol.py (train_rl hands in its live Policy module: own_models.as_policy)."""
from __future__ import annotations

import torch

from rlhf_mlflow.core.own_models import as_policy, as_reward_model
from rlhf_mlflow.decisions import watch as W
from rlhf_mlflow.decisions.certify import CertifyConfig
from rlhf_mlflow.evidence.certify_evidence import families_evidence, fixed_evidence


class PolicyWatch(W.Watch):
    """The watch (decisions/watch.py's Watch) with the models its evidence is drawn from."""

    def __init__(self, reference, rm, wrapper, gold: list[dict], cfg: W.WatchConfig = W.WatchConfig(),
                 shortcuts: list[dict] = ()):
        """`shortcuts`: the flagged shortcut rules to count (default: the wrapper's RULES, if any)."""
        super().__init__(gold, cfg)
        self.reference, self.rm, self.wrapper = as_policy(reference), as_reward_model(rm), wrapper
        shortcuts = list(shortcuts or getattr(wrapper, "rules", ()))
        ref_cfg = CertifyConfig(samples_per_prompt=cfg.reference_samples)
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.fixed = {f: fixed_evidence(self.reference, self.rm, wrapper, rows, shortcuts, ref_cfg, gen)
                      for f, rows in self.families.items()}

    @torch.no_grad()
    def estimate(self, step: int, policy) -> W.WatchPoint:
        """Every family's estimate of the policy's true quality (no state changed)."""
        gen = torch.Generator().manual_seed(self.cfg.seed)
        evidence = families_evidence(policy, self.reference, self.rm, self.wrapper, self.families, self.ccfg,
                                     gen, self.fixed)
        return self.point(step, evidence)

    def observe(self, step: int, policy) -> W.WatchPoint:
        """Estimate, remember, and mark the families that pass their peak at this point."""
        return self.add(self.estimate(step, policy))
