"""Small pure functions of KL-regularised policy-gradient RLHF, each unit-tested by hand."""
from __future__ import annotations

import torch


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-sequence KL estimate sum_t (log pi - log pi_ref) over the policy's own samples; (N, L) -> (N,)."""
    return (logprobs - ref_logprobs).sum(-1)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-sequence low-variance, non-negative estimate sum_t (r - 1 - log r), r = pi_ref / pi; (N,)."""
    log_ratio = ref_logprobs - logprobs
    return (log_ratio.exp() - 1 - log_ratio).sum(-1)


def shaped_rewards(rewards: torch.Tensor, kl: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """R - beta * KL per sequence."""
    return rewards - kl_coef * kl


def group_advantages(shaped: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE advantages with a per-prompt (group) mean baseline; shaped (B*G,) -> (B*G,)."""
    g = shaped.view(-1, group_size)  # (B, G)
    return (g - g.mean(1, keepdim=True)).reshape(-1)


def policy_gradient_loss(advantages: torch.Tensor, seq_logprobs: torch.Tensor) -> torch.Tensor:
    """-(A * log pi(y|x)).mean(); advantages are treated as constants."""
    return -(advantages.detach() * seq_logprobs).mean()
