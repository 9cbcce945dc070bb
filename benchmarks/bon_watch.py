"""The watch's best-of-n curve against the truth: does the estimated true quality of best-of-n follow
the oracle's as n grows, and where does each curve peak? (A benchmark may read the truth; the watch
never does.)

    python benchmarks/bon_watch.py [--world DIR] [--n-max 128] [--correction F] [--out DIR]

On the default world (built if missing): best-of-n of the world's policy against its reward model at
n = 1, 2, 4, ..., n_max. The watch (decisions/bon_watch.py) estimates each family's true quality from
the expert set, with the diagnostic's correction (fitted here when --correction is not given) and
without; the oracle grades best-of-n on GRADE_PER_FAMILY training prompts per family, with the same
nested selection. Prints per family the two curves, the n where each peaks and the fitted peak (the
best-of-n form, as an n: KL_n = log n - (n-1)/n), then `bon_watch_corr: X` (pooled correlation of
estimated and true gain over families and n, with the correction) and `bon_peak_agree: Y` (families
whose estimated peak n is within a factor 2 of the true one).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.overoptimisation_watch import correction_for, grading_prompts  # noqa: E402
from rlhf_mlflow.core import model as M  # noqa: E402
from rlhf_mlflow.core import records as D  # noqa: E402
from rlhf_mlflow.core import reward_model as R  # noqa: E402
from rlhf_mlflow.core import rollout  # noqa: E402
from rlhf_mlflow.core.process import configure_threads  # noqa: E402
from rlhf_mlflow.core.reward_wrapper import load_wrapper  # noqa: E402
from rlhf_mlflow.core.world_paths import WorldPaths  # noqa: E402
from rlhf_mlflow.decisions import bon_watch as BW  # noqa: E402
from rlhf_mlflow.evidence.bon import bon_points  # noqa: E402
from rlhf_mlflow.world.build import ensure_world  # noqa: E402
from rlhf_mlflow.world.oracle import Oracle  # noqa: E402

CHUNK = 64  # prompts per sampling pass


@torch.no_grad()
def true_curve(policy, rm, oracle: Oracle, prompts: list[dict], ns: list[int], seed: int = 1234) -> dict:
    """Per family and n, the oracle's mean true quality of best-of-n (raw reward model selection)."""
    g = torch.Generator().manual_seed(seed)
    n_max, fam, per_n = max(ns), [r["family"] for r in prompts], {n: [] for n in ns}
    for i in range(0, len(prompts), CHUNK):
        p = D.prompts_tensor(prompts[i:i + CHUNK])
        y = rollout.sample(policy, p, n_max, 1.0, g)
        rep = p.repeat_interleave(n_max, 0)
        raw = R.score(rm, rep, y).view(len(p), n_max)
        truth = oracle.true_quality(rep, y).view(len(p), n_max)
        for n in ns:
            per_n[n].append(truth[torch.arange(len(p)), raw[:, :n].argmax(1)])
    out: dict[str, dict[int, float]] = {}
    for n in ns:
        t = torch.cat(per_n[n]).double().numpy()
        for f in dict.fromkeys(fam):
            out.setdefault(f, {})[n] = float(t[[x == f for x in fam]].mean())
    return out


def peak_n(fit: dict) -> float | None:
    """The n whose KL_n is the fit's peak KL (None without a peak, inf beyond any n)."""
    if fit["peak_kl"] is None:
        return None
    lo, hi = 1.0, 2.0 ** 40
    if BW.bon_kl(hi) < fit["peak_kl"]:
        return math.inf
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if BW.bon_kl(mid) < fit["peak_kl"] else (lo, mid)
    return hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", help="a built world (default: the default world, built if missing)")
    ap.add_argument("--n-max", type=int, default=128)
    ap.add_argument("--correction", help="the diagnostic's correction (default: fitted, cached under --out)")
    ap.add_argument("--out", default="/tmp/bon_watch")
    a = ap.parse_args()
    configure_threads()
    os.makedirs(a.out, exist_ok=True)
    world = WorldPaths.at(a.world or ensure_world("worlds", progress=print)[0])
    policy, rm = M.load_policy(world.policy)[0], R.load_rm(world.reward_model)[0]
    gold = D.read_jsonl(world.expert_set, labelled=True)
    correction = a.correction or correction_for(world, a.out)
    ns = BW.ladder(a.n_max)
    truth = true_curve(policy, rm, Oracle(world.root), grading_prompts(world), ns)
    curves = {}
    for name, wrapper in (("corrected", load_wrapper(correction)), ("uncorrected", None)):
        points = bon_points(policy, rm, wrapper, gold, ns)
        curves[name] = (points, BW.bon_fits(points))
    points, fits = curves["corrected"]
    fams = list(fits)
    print(f"world {world.root}; best-of-n at n = {ns}; correction {correction}")
    xs, ys, agree = [], [], 0
    for f in fams:
        t = [truth[f][n] for n in ns]
        est = [p.estimate[f] for p in points]
        raw_est = [p.estimate[f] for p in curves["uncorrected"][0]]
        gain_t, gain_e = np.array(t) - t[0], np.array(est) - est[0]
        xs += list(gain_e)
        ys += list(gain_t)
        true_peak, est_peak = ns[int(np.argmax(t))], ns[int(np.argmax(est))]
        agree += max(true_peak, est_peak) <= 2 * min(true_peak, est_peak)
        fit_n = peak_n(fits[f])
        print(f"  {f:7s} truth  " + " ".join(f"{v:.3f}" for v in t) + f"   peak n {true_peak}")
        print(f"  {'':7s} watch  " + " ".join(f"{v:.3f}" for v in est) + f"   peak n {est_peak}; fitted "
              + ("none" if fit_n is None else f"{fit_n:.3g}") + f" (se at n_max {points[-1].se[f]:.3f})")
        print(f"  {'':7s} uncorr " + " ".join(f"{v:.3f}" for v in raw_est))
    within = [float(np.corrcoef([p.estimate[f] for p in points], [truth[f][n] for n in ns])[0, 1]) for f in fams]
    print(f"median within-family corr(watch, truth) over n: {statistics.median(within):.3f}")
    print(f"bon_watch_corr: {np.corrcoef(xs, ys)[0, 1]:.3f}")
    print(f"bon_peak_agree: {agree} of {len(fams)}")


if __name__ == "__main__":
    main()
