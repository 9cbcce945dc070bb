"""How well a reward model's scores agree with expert labels, per family: Pearson r with a Fisher-z
interval, and the paired bootstrap difference of two models' r on the same labels (the repair gate's
evidence, decisions/rm_gate.py)."""
from __future__ import annotations

import math

import torch

from rlhf_mlflow.core import vocab as V
from rlhf_mlflow.training.train_rm import pearson


def pearson_interval(x: torch.Tensor, y: torch.Tensor) -> dict:
    """Pearson r with its Fisher-z 95% interval (n >= 4; else r only, the interval the whole range).
    Scores that do not vary rank nothing: r = 0."""
    n = int(x.numel())
    r = pearson(x, y) if n >= 3 else float("nan")
    if math.isnan(r):
        return {"r": 0.0, "lo": -1.0, "hi": 1.0, "n": n}
    if n < 4:
        return {"r": r, "lo": -1.0, "hi": 1.0, "n": n}
    z, half = math.atanh(max(min(r, 0.999999), -0.999999)), 1.96 / math.sqrt(n - 3)
    return {"r": r, "lo": math.tanh(z - half), "hi": math.tanh(z + half), "n": n}


def per_family_agreement(scores: torch.Tensor, labels: torch.Tensor, fam: torch.Tensor) -> dict[str, dict]:
    return {f: pearson_interval(scores[fam == i], labels[fam == i])
            for i, f in enumerate(V.FAMILIES) if int((fam == i).sum()) >= 3}


def paired_difference(child: torch.Tensor, parent: torch.Tensor, y: torch.Tensor, fam: torch.Tensor,
                      seed: int, draws: int = 400) -> dict[str, dict]:
    """Per family: child r minus parent r on the same labels, with a paired bootstrap 95% interval."""
    gen = torch.Generator().manual_seed(seed + 11)
    out = {}
    for i, f in enumerate(V.FAMILIES):
        m = (fam == i).nonzero().flatten()
        if len(m) < 4:
            continue
        c, p, t = child[m], parent[m], y[m]
        point = _r(c, t) - _r(p, t)
        boot = torch.randint(0, len(m), (draws, len(m)), generator=gen)
        diffs = torch.tensor([_r(c[b], t[b]) - _r(p[b], t[b]) for b in boot])
        diffs = diffs[torch.isfinite(diffs)]
        lo, hi = (float(torch.quantile(diffs, 0.025)), float(torch.quantile(diffs, 0.975))) if len(diffs) else (-2.0, 2.0)
        out[f] = {"diff": point, "lo": lo, "hi": hi, "n": len(m)}
    return out


def _r(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson r (train_rm.pearson); 0 where either side does not vary (constant scores rank nothing)."""
    r = pearson(x, y)
    return 0.0 if math.isnan(r) else r
