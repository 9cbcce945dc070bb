"""How many expert labels does a policy's certification need? Certify one policy from K labels per family
on its own answers, for several K, interval rules and predictors, and print the half-widths (issue 31:
the labels-to-width curve of `make run`'s champion).

    python benchmarks/labels_to_width.py --world worlds/90873596517cfb63 --policy D [--rm-dir D]
        [--correction F] [--ks 10,20,30,50,80] [--looks 1,4] [--folds 0,10] [--seeds 0]

The labels come from the world's synthetic expert (world/annotator.py), drawn as `label-requests`
draws them (the first K of each family's seeded order of expert prompts); certify runs as `main` runs it
(`--looks 4`: the union bound over main's four looks) with its predictor (`--folds 10`, estimator 7) or
the calibrated reward model alone (`--folds 0`, estimator 6); each `--seeds` value is a label draw of its
own. Prints per (draw, K, looks, folds) the balanced interval's half-width and the families' mean
half-width; last line `half_width_at_120: X` (20 per family, main's looks and predictor, the mean over
draws)."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhf_mlflow.core import model as M  # noqa: E402
from rlhf_mlflow.core import records as D  # noqa: E402
from rlhf_mlflow.core.world_paths import WorldPaths  # noqa: E402
from rlhf_mlflow.decisions import certify as C  # noqa: E402
from rlhf_mlflow.evidence.certify import certify  # noqa: E402
from rlhf_mlflow.evidence.label_requests import draw_requests  # noqa: E402
from rlhf_mlflow.world.annotator import label_requests  # noqa: E402


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", required=True)
    ap.add_argument("--policy", required=True, help="the policy's checkpoint directory")
    ap.add_argument("--rm-dir", help="the reward model certify uses (default: the world's)")
    ap.add_argument("--correction", help="a reward-wrapper file for it")
    ap.add_argument("--ks", default="10,20,30,50,80", help="labels per family, comma-separated")
    ap.add_argument("--looks", default="1,4", help="interval rules: looks union-bounded over")
    ap.add_argument("--folds", default="0,10", help="predictors: 0 the reward model, N the cross-fitted head")
    ap.add_argument("--seeds", default="0", help="label draws (label-requests' seed), comma-separated")
    a = ap.parse_args()
    world = WorldPaths.at(a.world)
    rm_dir = a.rm_dir or world.reward_model
    gold = D.read_jsonl(world.expert_set, labelled=True)
    policy = M.load_policy(a.policy)[0]
    n_fam = len(D.group_by_family(gold))
    print(f"{'draw':>4} {'K':>4} {'labels':>6} {'looks':>5} {'folds':>5} {'balanced':>24} {'half-width':>10} {'family hw':>9}")
    found: dict[tuple, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed, k in [(seed, k) for seed in ints(a.seeds) for k in ints(a.ks)]:
            path = os.path.join(tmp, f"labels-{seed}-{k}.jsonl")
            D.write_jsonl(path, label_requests(world, draw_requests(policy, gold, k, seed=seed, prefix=f"req{seed}")))
            for looks in ints(a.looks):
                for folds in ints(a.folds):
                    cfg = replace(C.CertifyConfig(), label_looks=looks, label_folds=folds)
                    r = certify(a.policy, world.policy, world.expert_set, rm_dir=rm_dir,
                                correction=a.correction, cfg=cfg, policy_labels=path)
                    b = r["balanced"]
                    fams = [(row["hi"] - row["lo"]) / 2 for row in r["families"].values() if row["certifiable"]]
                    shown = f"{b['estimate']:.3f} [{b['lo']:.3f}, {b['hi']:.3f}]" if b["certifiable"] else "refused"
                    hw = (b["hi"] - b["lo"]) / 2 if b["certifiable"] else float("nan")
                    found.setdefault((k, looks, folds), []).append(hw)
                    print(f"{seed:>4} {k:>4} {n_fam * k:>6} {looks:>5} {folds:>5} {shown:>24} {hw:>10.3f} "
                          f"{sum(fams) / max(1, len(fams)):>9.3f}", flush=True)
    main_rule = (20, max(ints(a.looks)), C.CertifyConfig().label_folds)
    if main_rule in found:
        print(f"half_width_at_120: {sum(found[main_rule]) / len(found[main_rule]):.3f}")


if __name__ == "__main__":
    main()
