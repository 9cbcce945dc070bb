"""This project's own models as one implementation of the model protocol (core/protocol.py), and how a
step opens a policy or a reward model: ours from a seed-format checkpoint directory, or any implementation
named by an import path (`--policy-impl package.module:factory`, `--reward-impl ...`: the factory is
called with the location given).

OwnPolicy samples with rollout's cached sampler (its log-probs at temperature 1 come for free) and scores
responses with model.sequence_logprobs; OwnRewardModel scores with reward_model.score. `as_policy` /
`as_reward_model` let a caller hand in one of our modules as it is (a training run's live policy, a member
of a stacked batch) or any protocol object."""
from __future__ import annotations

import torch

from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import protocol as P
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core import rollout

POLICY_IMPL = "rlhf_mlflow.core.own_models:load_policy"
REWARD_IMPL = "rlhf_mlflow.core.own_models:load_reward_model"
"""The import paths of our own loaders (what `--policy-impl` / `--reward-impl` default to)."""


class OwnPolicy:
    """core/model.py's Policy (or a stacked member bound to its slice) as a protocol Policy."""

    def __init__(self, module: M.Policy, name: str = "policy"):
        self.module, self.name = module, name

    def sample(self, prompts: torch.Tensor, n: int, temperature: float, generator: torch.Generator | None,
               logprobs: list | None = None) -> torch.Tensor:
        return rollout.sample(self.module, prompts, n, temperature, generator, logprobs)

    def logprobs(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        return M.sequence_logprobs(self.module, prompts, responses)


class OwnRewardModel:
    """core/reward_model.py's RewardModel (its label head included) as a protocol RewardModel."""

    def __init__(self, module: R.RewardModel, name: str = "reward model"):
        self.module, self.name = module, name

    def score(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        return R.score(self.module, prompts, responses)


def load_policy(location: str) -> OwnPolicy:
    """Our policy from a checkpoint directory (policy.safetensors + config.json)."""
    return OwnPolicy(M.load_policy(location)[0], location)


def load_reward_model(location: str) -> OwnRewardModel:
    """Our reward model from its directory (rm.safetensors + config.json, a label head beside them)."""
    return OwnRewardModel(R.load_rm(location)[0], location)


def as_policy(policy) -> P.Policy:
    """A protocol Policy: one of our Policy modules wrapped, any protocol object as it is."""
    if isinstance(policy, M.Policy):
        return OwnPolicy(policy)
    if not isinstance(policy, P.Policy):
        raise TypeError(f"{type(policy).__name__} is not a policy (core/protocol.py: sample and logprobs)")
    return policy


def as_reward_model(rm) -> P.RewardModel | None:
    """A protocol RewardModel (None stays None): our RewardModel wrapped, any protocol object as it is."""
    if isinstance(rm, R.RewardModel):
        return OwnRewardModel(rm)
    if rm is not None and not isinstance(rm, P.RewardModel):
        raise TypeError(f"{type(rm).__name__} is not a reward model (core/protocol.py: score)")
    return rm


def open_policy(location: str, impl: str | None = None, option: str = "--policy-impl") -> P.Policy:
    """The policy at `location`: ours (a checkpoint directory) or opened by the factory `impl` names."""
    return load_policy(location) if not impl or impl == POLICY_IMPL else P.load_impl(impl, location, "policy", option)


def open_reward_model(location: str, impl: str | None = None, option: str = "--reward-impl") -> P.RewardModel:
    """The reward model at `location`: ours (its directory) or opened by the factory `impl` names."""
    if not impl or impl == REWARD_IMPL:
        return load_reward_model(location)
    return P.load_impl(impl, location, "reward model", option)
