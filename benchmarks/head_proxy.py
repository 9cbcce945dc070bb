"""How much a label head fitted on K labels per family would move a policy, without RL: the proxy behind
docs/REPAIR.md "The guided adaptive head" (a benchmark: it reads the truth; nothing that decides does).

    python benchmarks/head_proxy.py [--worlds SEED:SPEC ...] [--per-family 25 50 100] [--out DIR]

Per world: round 0 as benchmarks/reward_repair.py trains it (the recipe on the world's reward model minus
the diagnostic's correction), 100 labels per family bought on its answers (the same draw as that
benchmark's first repair round), then for each K and each fit the head alone on the expert set plus the
first K labels per family:
  - `lasso`: one lasso at L1 1e-4 (the head before 2026-12-07);
  - `adaptive`: the adaptive group lasso (core/label_head_fit.adaptive_lasso) on the expert labels;
  - `guided`: the same with the crowd's QA sample (its flagged premiums out) as the guide at GUIDE_WEIGHT.
Each head's score tilts the reference policy's samples (96 per prompt, 150 prompts per family) by
exp(score / 0.05), the recipe's KL weight, and the line is the true quality of the tilted samples (the
true reward's tilt is the `oracle` line): what KL-regularised RL on that head alone would reach were it
to find the optimum among those samples. The fits are compared with one another on the same labels; the
proxy ranks them as RL did on the default world (docs/REPAIR.md), it does not replace RL.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import reward_repair as RB  # noqa: E402
from rlhf_mlflow.core import label_head as LH  # noqa: E402
from rlhf_mlflow.core import label_head_fit as HF  # noqa: E402
from rlhf_mlflow.core import model as M  # noqa: E402
from rlhf_mlflow.core import records as D  # noqa: E402
from rlhf_mlflow.core import rollout  # noqa: E402
from rlhf_mlflow.core import vocab as V  # noqa: E402
from rlhf_mlflow.core.world_paths import WorldPaths  # noqa: E402
from rlhf_mlflow.training.repair_rm import remove_premiums  # noqa: E402
from rlhf_mlflow.world import corruptions as C  # noqa: E402
from rlhf_mlflow.world.build import ensure_world  # noqa: E402

FITS = ("lasso", "adaptive", "guided")
BETA = 0.05
SAMPLES, PROMPTS = 96, 150


def _ids(rows: list[dict]) -> torch.Tensor:
    return torch.cat([D.prompts_tensor(rows), D.responses_tensor(rows)], 1)


def _blocks(rows: list[dict], weight: float | None = None) -> HF.Blocks:
    fam, flat = LH.indicator_index(_ids(rows))
    y = torch.tensor([r["label"] for r in rows], dtype=torch.float32)
    return HF.Blocks(flat, fam, y, len(V.FAMILIES), None if weight is None else torch.full((len(rows),), weight))


def head_of(fit: str, rows: list[dict], guide: list[dict]) -> LH.LabelHead:
    """The head alone (no trunk) of one fit on `rows`."""
    p = _blocks(rows)
    g = _blocks(guide, HF.GUIDE_WEIGHT) if fit == "guided" else None
    w, b = HF.adaptive_lasso(p, fit="lasso" if fit == "lasso" else "adaptive", guide=g)
    return LH.LabelHead(w.reshape(LH.SHAPE), torch.zeros(len(V.FAMILIES)), b)


def tilted_truth(scores: torch.Tensor, truth: torch.Tensor) -> float:
    """The truth of the samples reweighted by exp(score / BETA) within each prompt's SAMPLES."""
    w = torch.softmax(scores.double().reshape(-1, SAMPLES) / BETA, 1)
    return float((w * truth.double().reshape(-1, SAMPLES)).sum(1).mean())


def one_world(seed: int, spec: str, args) -> None:
    root, manifest = ensure_world(args.cache, seed, C.load_spec(spec), "full", progress=RB.say)
    w = RB.WorldRun(WorldPaths.at(root), os.path.join(args.out, manifest["world_hash"]), 1.0)
    wrapper, rules = w.correction(w.world.reward_model, "r0")
    policy, truth0, _ = w.rl(w.world.reward_model, wrapper, seed=0)
    labels = w.buy(policy, max(args.per_family), "0-r1")
    guide = remove_premiums(w.qa, rules)
    by_family = D.group_by_family(w.prompts)
    prompts = D.prompts_tensor([r for f in V.FAMILIES for r in by_family[f][:PROMPTS]])
    reference, _ = M.load_policy(w.world.policy)
    with torch.no_grad():
        responses = rollout.sample(reference, prompts, SAMPLES, 1.0, torch.Generator().manual_seed(7))
    prompts = prompts.repeat_interleave(SAMPLES, 0)
    truth = w.oracle.true_quality(prompts, responses)
    ids = torch.cat([prompts, responses], 1)
    print(f"\nworld {manifest['world_hash']} ({spec}, seed {seed}): round 0 truth {truth0:.3f}; "
          f"reference {float(truth.mean()):.3f}, oracle tilt {tilted_truth(truth, truth):.3f}")
    print("| labels per family | " + " | ".join(args.fits) + " |")
    print("|---|" + "---|" * len(args.fits))
    bought = D.group_by_family(labels)
    for k in args.per_family:
        rows = w.gold + [r for f in V.FAMILIES for r in bought.get(f, [])[:k]]
        cells = [tilted_truth(head_of(fit, rows, guide).combine(ids, None), truth) for fit in args.fits]
        print(f"| {k} | " + " | ".join(f"{c:.3f}" for c in cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", nargs="+", default=["0:default"], help="SEED:SPEC (default, clean or a spec file)")
    ap.add_argument("--per-family", nargs="+", type=int, default=[25, 50, 100])
    ap.add_argument("--fits", nargs="+", default=list(FITS), choices=FITS)
    ap.add_argument("--cache", default="worlds")
    ap.add_argument("--out", default="/tmp/head_proxy")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    for item in args.worlds:
        seed, _, spec = item.partition(":")
        one_world(int(seed), spec or "default", args)


if __name__ == "__main__":
    main()
