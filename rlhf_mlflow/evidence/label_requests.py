"""Label requests from a live policy (decisions/label_requests.py says why these, and checks the labels
that come back): per family, the expert set's prompts in a seeded order, one response of the policy to
each at the deployment temperature, drawn from the family's own stream. The policy is any implementation
of core/protocol.py."""
from __future__ import annotations

import torch

from rlhf_mlflow.core import protocol as P
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.own_models import as_policy
from rlhf_mlflow.decisions.label_requests import request_stream


def draw_requests(policy, expert_set: list[dict], per_family: int, families: list[str] | None = None,
                  seed: int = 0, temperature: float = 1.0, prefix: str = "req") -> list[dict]:
    """Up to `per_family` requests per family (seed-format records without labels), one per distinct
    expert-set prompt; ids are `<prefix>-<family>-<k>`."""
    policy = as_policy(policy)
    by_family = D.group_by_family(expert_set)
    out = []
    for family in [f for f in V.FAMILIES if f in by_family and (families is None or f in families)]:
        rows = by_family[family]
        gen = request_stream(seed, family)
        order = torch.randperm(len(rows), generator=gen).tolist()
        prompts = D.prompts_tensor([rows[i] for i in order])
        with torch.no_grad():
            responses = P.sample(policy, prompts, 1, temperature, gen)        # (n, L), one per prompt
        for k, (i, y) in enumerate(zip(order[:per_family], responses.tolist())):
            out.append({"id": f"{prefix}-{family}-{k:03d}", "family": family, "attrs": list(rows[i]["attrs"]),
                        "response": V.decode_response(y)})
    return out
