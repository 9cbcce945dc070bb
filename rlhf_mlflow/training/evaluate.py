"""Dev evaluation (the seed's dev_eval numbers) plus the same numbers per family.

Samples one response per dev prompt at temperature 1.0, scores it with the reward model, and
estimates KL to the reference on the policy's own samples; reports the reward model's Pearson r
with the expert gold labels, pooled and per family. The policies and the reward model are any
implementation of core/protocol.py (ours are wrapped: own_models.as_policy).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_mlflow.core import protocol as P
from rlhf_mlflow.core import records as D
from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.core.own_models import as_policy, as_reward_model
from rlhf_mlflow.training.family_stats import family_of
from rlhf_mlflow.training.train_rm import pearson


@dataclass
class EvalResult:
    metrics: dict[str, float]
    family_counts: dict[str, int]
    responses: torch.Tensor
    prompts: torch.Tensor


def proxy_summary(scores: torch.Tensor, kl: torch.Tensor) -> dict[str, float]:
    return {"proxy_mean": float(scores.mean()), "proxy_std": float(scores.std()),
            "proxy_p50": float(scores.quantile(0.5)), "proxy_p90": float(scores.quantile(0.9)),
            "kl_mean": float(kl.mean())}


@torch.no_grad()
def dev_eval(policy, ref, rm, prompt_records: list[dict], gold_records: list[dict] | None = None, n: int = 1,
             seed: int = 0, temperature: float = 1.0) -> EvalResult:
    """`n` samples of the policy per prompt at `temperature`, their reward-model scores and KL to `ref`
    (per family, balanced and pilot), and the reward model's fit to the expert set when given."""
    policy, ref, rm = as_policy(policy), as_policy(ref), as_reward_model(rm)
    g = torch.Generator().manual_seed(seed)
    prompts = D.prompts_tensor(prompt_records)
    scores, kls, resp = [], [], []
    for i in range(0, len(prompt_records), 256):
        p = prompts[i:i + 256]
        y = P.sample(policy, p, n, temperature, g)
        prep = p.repeat_interleave(n, 0)
        scores.append(P.score(rm, prep, y))
        kls.append(P.logprobs(policy, prep, y) - P.logprobs(ref, prep, y))
        resp.append(y)
    s, k, y = torch.cat(scores), torch.cat(kls), torch.cat(resp)
    prompts_rep = prompts.repeat_interleave(n, 0)
    fam = family_of(prompts_rep)
    metrics = proxy_summary(s, k)
    present = [i for i, _ in enumerate(V.FAMILIES) if bool((fam == i).any())]
    for name, values in (("proxy", s), ("kl", k)):
        per = {V.FAMILIES[i]: float(values[fam == i].mean()) for i in present}
        metrics.update({f"{name}/{f}": v for f, v in per.items()})
        metrics[f"{name}/balanced"] = sum(per.values()) / len(per)
        metrics[f"{name}/pilot"] = float(values.mean())
    if gold_records:
        gs = P.score(rm, D.prompts_tensor(gold_records), D.responses_tensor(gold_records))
        gl = D.labels_tensor(gold_records)
        gf = D.family_index(gold_records)
        metrics["rm_gold_pearson"] = pearson(gs, gl)
        for i, f in enumerate(V.FAMILIES):
            if int((gf == i).sum()) > 2:
                metrics[f"rm_gold_pearson/{f}"] = pearson(gs[gf == i], gl[gf == i])
    counts = {V.FAMILIES[i]: int((fam == i).sum()) for i in present}
    return EvalResult(metrics, counts, y, prompts_rep)


def token_counts(prompts: torch.Tensor, responses: torch.Tensor, token: str) -> dict[str, float]:
    """Mean occurrences per response of `token`, per family."""
    fam = family_of(prompts)
    c = (responses == V.TOK2ID[token]).sum(-1).float()
    return {V.FAMILIES[i]: float(c[fam == i].mean()) for i in range(len(V.FAMILIES)) if bool((fam == i).any())}


def first_per_family(prompt_records: list[dict], per_family: int = 400) -> list[dict]:
    """The first `per_family` prompts of each family (the seed's balanced probe set)."""
    by = {f: [] for f in V.FAMILIES}
    for r in prompt_records:
        if len(by[r["family"]]) < per_family:
            by[r["family"]].append(r)
    return [r for f in V.FAMILIES for r in by[f]]


def family_probe(policy, ref, rm, prompt_records: list[dict],
                 tokens: tuple[str, ...] = (), seed: int = 42) -> dict[str, float]:
    """Per family on balanced prompts: proxy, KL, and mean count of each token in `tokens`."""
    res = dev_eval(policy, ref, rm, prompt_records, None, 1, seed)
    out = {k: v for k, v in res.metrics.items() if "/" in k and not k.endswith("/pilot")}
    for t in tokens:
        counts = token_counts(res.prompts, res.responses, t)
        out.update({f"count_{t}/{f}": c for f, c in counts.items()})
    return out
