"""The oracle: the only reader of a world's `secret/`. It measures; it never decides.

Its numbers are logged under `truth/...` names so that they never mix with estimates.
"""
from __future__ import annotations

import os

import torch

from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import rollout
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.errors import InputError, read_json
from rlhf_mlflow.core.files import atomic_write_text
from rlhf_mlflow.training.family_stats import family_of
from rlhf_mlflow.world.truth import Truth


class Oracle:
    def __init__(self, world_dir: str):
        path = os.path.join(world_dir, "secret", "truth.json")
        if not os.path.isfile(path):
            raise InputError(f"{world_dir}: no secret/truth.json: the oracle needs a world built by build-world")
        blob = read_json(path)
        self.truth = Truth.from_json(blob["truth"])
        self.spec = blob["spec"]

    def true_quality(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Fraction of correct positions (N,) for responses (N, L) to prompts (N, P)."""
        return self.truth.quality(prompts, responses)

    def score_records(self, records: list[dict]) -> list[float]:
        return self.true_quality(D.prompts_tensor(records), D.responses_tensor(records)).tolist()

    @torch.no_grad()
    def grade_policy(self, policy: M.Policy, prompt_records: list[dict], n: int = 4, seed: int = 1234,
                     temperature: float = 1.0) -> dict[str, float]:
        """True quality of a policy's samples: `truth/<family>` and `truth/balanced`."""
        g = torch.Generator().manual_seed(seed)
        prompts = D.prompts_tensor(prompt_records)
        responses = rollout.sample(policy, prompts, n, temperature, g)
        prompts_rep = prompts.repeat_interleave(n, 0)
        q = self.true_quality(prompts_rep, responses)
        fam = family_of(prompts_rep)
        per = {f: float(q[fam == i].mean()) for i, f in enumerate(V.FAMILIES) if bool((fam == i).any())}
        out = {f"truth/{f}": v for f, v in per.items()}
        out["truth/balanced"] = sum(per.values()) / len(per)
        return out


ORACLE_WRAPPER = '''"""Reward = the world's true quality (the oracle). For measuring the ceiling a recipe can reach
with the true reward: never a decision input."""
from rlhf_mlflow.world.oracle import Oracle

_ORACLE = Oracle({world!r})


def transform(records, response_tokens, rewards):
    return _ORACLE.score_records([dict(r, response=t) for r, t in zip(records, response_tokens)])
'''


def write_oracle_reward(world_dir: str, path: str) -> str:
    """A reward-wrapper file that replaces the reward model's score with the true quality."""
    atomic_write_text(path, ORACLE_WRAPPER.format(world=os.path.abspath(world_dir)))
    return path
