"""Would label requests chosen where the predictor is unsure (active inference, Zrnic & Candes 2024) certify
a policy with fewer expert labels than uniform requests (issue 47)? Labels-to-width curves of uniform and
active requests on one policy, with coverage over many label draws (a benchmark may read the truth: it
grades and plays the expert).

    python benchmarks/active_requests.py --world W --policy CKPT [--rm-dir D] [--samples 4]
        [--ks 10,20,30,50] [--reps 200] [--mix 0.2]

Per family, the pool is the policy's `--samples` answers on each of the expert set's prompts, its truth
the oracle's. The predictor f is fixed before any label: the reward model with a label head fitted on the
expert set alone (core/label_head_fit.py, cross-fitted over 10 folds, the pool predicted by their mean).
A design requests each label with probability q_i over the pool (with replacement; K per family), and
the estimate of the pool's mean truth is mean_pool(f) + mean_j (y_j - f_j) / (N q_j), y the expert's label
(truth + the world's expert noise); its 90% interval the t interval of those K terms, widened as certify
widens a labelled interval (labelled.LABEL_WIDENING). Uniform requests
are q = 1/N (PPI with lambda = 1); active ones q proportional to u + mix * mean(u) for a per-answer
uncertainty u known before labelling:
  f(1-f)     sqrt(f (1 - f)): a fraction-of-8 label's spread where the prediction sits;
  heads      the 10 fold heads' spread on the answer (disagreement of predictors fitted on other rows);
  novelty    sum over the answer's label-head indicators of 1 / (1 + their count in the expert set);
  oracle     |y - f| itself: the bound no design can beat (not a usable design: it needs the label).
The estimand is the pool's mean (the prompts' own spread is the same under every design, and left out),
so the widths compare designs, not certify's intervals. Prints per design and K the families' mean
half-width, its ratio to uniform's and the lowest family coverage; last lines
`width_ratio_<design>: X` (mean over K and families) and `coverage_min: Y` (every design and K).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rlhf_mlflow.core import label_head as LH  # noqa: E402
from rlhf_mlflow.core import label_head_fit as HF  # noqa: E402
from rlhf_mlflow.core import model as M  # noqa: E402
from rlhf_mlflow.core import records as D  # noqa: E402
from rlhf_mlflow.core import reward_model as RM  # noqa: E402
from rlhf_mlflow.core import rollout  # noqa: E402
from rlhf_mlflow.core import vocab as V  # noqa: E402
from rlhf_mlflow.core.world_paths import WorldPaths  # noqa: E402
from rlhf_mlflow.decisions.labelled import LABEL_WIDENING, t_quantile  # noqa: E402
from rlhf_mlflow.world.annotator import expert_noise  # noqa: E402
from rlhf_mlflow.world.oracle import Oracle  # noqa: E402

DESIGNS = ("uniform", "f(1-f)", "heads", "novelty", "oracle")
LEVEL = 0.90


def pool(world: WorldPaths, policy_dir: str, rm_dir: str, samples: int, seed: int = 7) -> dict:
    """The policy's answers on the expert prompts with their truth, the predictor and every design's u."""
    gold = D.read_jsonl(world.expert_set, labelled=True)
    rm, _ = RM.load_rm(rm_dir)
    rm.label_head = None                                  # the trunk: its head is refitted on the expert set
    gp, gr, gy = D.prompts_tensor(gold), D.responses_tensor(gold), D.labels_tensor(gold).float()
    gids = torch.cat([gp, gr], 1)
    folds = torch.from_numpy(np.random.default_rng(0).permutation(len(gold)) % 10)
    heads = HF.cross_fitted_heads(gids, gy, RM.score(rm, gp, gr), folds)
    with torch.no_grad():
        resp = rollout.sample(M.load_policy(policy_dir)[0], gp, samples, 1.0, torch.Generator().manual_seed(seed))
    prep = gp.repeat_interleave(samples, 0)
    ids = torch.cat([prep, resp], 1)
    trunk = RM.score(rm, prep, resp)
    preds = torch.stack([h.combine(ids, trunk) for h in heads]).double().numpy()
    f = preds.mean(0)
    clipped = np.clip(f, 0.02, 0.98)
    return {"family": D.family_index(gold).repeat_interleave(samples).numpy(), "f": f,
            "q": Oracle(world.root).true_quality(prep, resp).double().numpy(),
            "u": {"f(1-f)": np.sqrt(clipped * (1 - clipped)), "heads": preds.std(0), "novelty": novelty(gids, ids)}}


def novelty(expert_ids: torch.Tensor, ids: torch.Tensor) -> np.ndarray:
    """Per answer, the sum over its label-head indicators of 1 / (1 + how often the expert set has them)."""
    gf, gflat = LH.indicator_index(expert_ids)
    pf, pflat = LH.indicator_index(ids)
    g, p = LH.in_block(gflat, gf), LH.in_block(pflat, pf)
    count = torch.bincount(g[g >= 0], minlength=len(V.FAMILIES) * LH.PER_FAMILY).double()
    seen = torch.where(p >= 0, count[p.clamp(min=0)], torch.zeros((), dtype=torch.float64))
    return (1.0 / (1.0 + seen)).sum(1).numpy()


def draws(f: np.ndarray, q: np.ndarray, u: np.ndarray | None, k: int, reps: int, mix: float, noise: float,
          rng: np.random.Generator) -> tuple[float, float]:
    """(mean half-width, coverage of the pool's mean truth) of `reps` draws of k labels with probabilities
    proportional to u + mix mean(u) (None: uniform)."""
    N = len(f)
    prob = np.full(N, 1.0 / N) if u is None else (u + mix * u.mean() + 1e-12) / (u + mix * u.mean() + 1e-12).sum()
    truth, base = q.mean(), f.mean()
    t = t_quantile(1 - (1 - LEVEL) / 2, k - 1)
    idx = rng.choice(N, size=(reps, k), p=prob)
    y = q[idx] + noise * rng.standard_normal((reps, k))
    terms = (y - f[idx]) / (N * prob[idx])
    est, hw = base + terms.mean(1), LABEL_WIDENING * t * terms.std(1, ddof=1) / np.sqrt(k)
    return float(hw.mean()), float(np.mean(np.abs(est - truth) <= hw))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", required=True)
    ap.add_argument("--policy", required=True, help="the policy's checkpoint directory")
    ap.add_argument("--rm-dir", help="the reward model whose trunk the predictor stacks on (default: the world's)")
    ap.add_argument("--samples", type=int, default=4, help="answers per expert prompt in the pool")
    ap.add_argument("--ks", default="10,20,30,50", help="labels per family, comma-separated")
    ap.add_argument("--reps", type=int, default=200, help="label draws per family, design and K")
    ap.add_argument("--mix", type=float, default=0.2, help="share of mean(u) added to every answer's u")
    a = ap.parse_args()
    world = WorldPaths.at(a.world)
    p = pool(world, a.policy, a.rm_dir or world.reward_model, a.samples)
    noise, ks = expert_noise(world), [int(k) for k in a.ks.split(",") if k]
    rng = np.random.default_rng(0)
    found = {}   # (design, k) -> [(hw, coverage) per family]
    for i, family in enumerate(V.FAMILIES):
        sel = p["family"] == i
        if not sel.any():
            continue
        f, q = p["f"][sel], p["q"][sel]
        us = {"uniform": None, **{d: p["u"][d][sel] for d in p["u"]},
              "oracle": np.abs(q - f) + noise * np.sqrt(2 / np.pi)}   # E|y - f| given the answer, roughly
        for d in DESIGNS:
            for k in ks:
                found.setdefault((d, k), []).append(draws(f, q, us[d], k, a.reps, a.mix, noise, rng))
    report(found, ks, a.reps)


def report(found: dict, ks: list[int], reps: int) -> None:
    print(f"{'design':>8} {'K':>4} {'half-width':>10} {'x uniform':>9} {'labels for uniform width':>24} "
          f"{'coverage min':>12}   ({reps} draws per family)")
    ratios, cover = {}, []
    for d in DESIGNS:
        for k in ks:
            hw = np.mean([h for h, _ in found[(d, k)]])
            ratio = hw / np.mean([h for h, _ in found[("uniform", k)]])
            cmin = min(c for _, c in found[(d, k)])
            ratios.setdefault(d, []).append(ratio)
            if d != "oracle":
                cover.append(cmin)
            print(f"{d:>8} {k:>4} {hw:10.4f} {ratio:9.3f} {k * ratio ** 2:24.1f} {cmin:12.3f}")
    for d in DESIGNS[1:]:
        print(f"width_ratio_{d}: {np.mean(ratios[d]):.3f}")
    print(f"coverage_min: {min(cover):.3f}")


if __name__ == "__main__":
    main()
