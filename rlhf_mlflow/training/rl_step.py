"""One RL step's parts that a single run (train_rl.Learner) and stacked runs (batched.py) share: the frozen
models that score a batch, and the step's maths from log-probs and rewards to the loss.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import reward_ensemble as RE
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core import rollout
from rlhf_mlflow.core.checkpoint import freeze
from rlhf_mlflow.core.reward_wrapper import Transform, apply_wrapper
from rlhf_mlflow.training import rl_math
from rlhf_mlflow.training.rl_config import RLConfig


METRICS = ["proxy", "reward", "shaped", "kl", "kl_k3", "entropy"]


def metric_names(cfg: RLConfig) -> list[str]:
    """METRICS, and with an ensemble its members' spread (standard deviation) per response."""
    return METRICS + (["spread"] if cfg.reward_ensemble else [])


ENSEMBLE_CHUNK = 8
"""Sequences per pass of the stacked ensemble's forward: K members' activations in a core's L2 cache
(at K = 4, 8 per pass measured fastest of 4-32)."""


@dataclass
class Frozen:
    """The reference policy and reward model, with their first-block tables built once; `ensemble`,
    the stacked members of cfg.reward_ensemble, scores in the reward model's place when given."""
    ref: M.Policy
    rm: R.RewardModel
    ref_table: tuple[torch.Tensor, torch.Tensor]
    rm_table: tuple[torch.Tensor, torch.Tensor]
    ensemble: RE.Stacked | None = None
    penalty: float = 0.0

    @classmethod
    def load(cls, cfg: RLConfig) -> "Frozen":
        ref = freeze(M.load_policy(cfg.policy_ref)[0])
        rm = freeze(R.load_rm(cfg.reward_model)[0])
        ensemble = RE.Stacked.load(cfg.reward_ensemble) if cfg.reward_ensemble else None
        with torch.inference_mode():
            return cls(ref, rm, ref.first_layer_table(), rm.first_layer_table(), ensemble, cfg.ensemble_penalty)

    def ref_logprobs(self, prompts: torch.Tensor, responses: torch.Tensor, group: int) -> torch.Tensor:
        """Per-token log-probs (N, L) of the responses under the reference (rollout.grouped_logprobs)."""
        with torch.inference_mode():
            return rollout.grouped_logprobs(self.ref, prompts, responses, group, self.ref_table)[0]

    def reward(self, prompts_rep: torch.Tensor, responses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The reward of each response and, with an ensemble, its members' spread (standard deviation)."""
        if self.ensemble is None:
            return R.score(self.rm, prompts_rep, responses, R.RL_CHUNK, self.rm_table), None
        scores = self.ensemble.score(prompts_rep, responses, ENSEMBLE_CHUNK)  # (K, N)
        return RE.penalised(scores, self.penalty), scores.std(0)


def policy_loss(cfg: RLConfig, wrap: Transform | None, records: list[dict], responses: torch.Tensor,
                logprobs: torch.Tensor, logp: torch.Tensor, ref_logprobs: torch.Tensor,
                scores: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """From one run's B*G responses (B = len(records)), their per-token log-probs under the policy (with
    gradient) and the reference, its log-softmax and the reward model's (raw, spread) scores: per-sample
    metrics and the policy-gradient loss (the reward reshaped by `wrap`, minus kl_coef * KL, group baseline)."""
    G = cfg.samples_per_prompt
    raw, spread = scores
    rewards = raw if wrap is None else apply_wrapper(
        wrap, cfg.reward_wrapper or "<callable>", [records[i // G] for i in range(len(responses))], responses, raw)
    with torch.no_grad():
        lp = logprobs.detach()
        kl = rl_math.kl_k1(lp, ref_logprobs)
        shaped = rl_math.shaped_rewards(rewards, kl, cfg.kl_coef)
        advantages = rl_math.group_advantages(shaped, G)
        logp = logp.detach()
        stats = {"proxy": raw, "reward": rewards, "shaped": shaped, "kl": kl,
                 "kl_k3": rl_math.kl_k3(lp, ref_logprobs), "entropy": -(logp.exp() * logp).sum(-1).mean(-1)}
        if spread is not None:
            stats["spread"] = spread
    return stats, rl_math.policy_gradient_loss(advantages, logprobs.sum(-1))
