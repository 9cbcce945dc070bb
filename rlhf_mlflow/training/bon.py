"""Best-of-N: sample N responses per prompt and keep the one the reward model scores highest."""
from __future__ import annotations

import torch

from rlhf_mlflow.core import model as M
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import reward_model as R
from rlhf_mlflow.core import rollout
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.training.family_stats import family_of


@torch.no_grad()
def best_of_n(policy: M.Policy, rm: R.RewardModel, prompt_records: list[dict], n: int = 32,
              temperature: float = 1.0, seed: int = 0) -> tuple[list[dict], dict[str, float]]:
    """Returns (records with the chosen response and its proxy score, per-family metrics)."""
    if n < 1:
        raise ValueError("n must be >= 1")
    g = torch.Generator().manual_seed(seed)
    prompts = D.prompts_tensor(prompt_records)
    chosen, best, first = [], [], []
    for i in range(0, len(prompt_records), 128):
        p = prompts[i:i + 128]
        y = rollout.sample(policy, p, n, temperature, g)  # (b*n, L)
        s = R.score(rm, p.repeat_interleave(n, 0), y).view(-1, n)  # (b, n)
        top = s.argmax(1)
        chosen.append(y.view(-1, n, y.shape[1])[torch.arange(len(p)), top])
        best.append(s.max(1).values)
        first.append(s[:, 0])
    y, s, s1 = torch.cat(chosen), torch.cat(best), torch.cat(first)
    records = [dict(r, response=V.decode_response(t), proxy=round(float(v), 5))
               for r, t, v in zip(prompt_records, y.tolist(), s)]
    fam = family_of(prompts)
    metrics = {}
    for name, vals in (("bon_proxy", s), ("sample_proxy", s1)):
        per = {f: float(vals[fam == i].mean()) for i, f in enumerate(V.FAMILIES) if bool((fam == i).any())}
        metrics.update({f"{name}/{f}": v for f, v in per.items()})
        metrics[f"{name}/balanced"] = sum(per.values()) / len(per)
    return records, metrics
