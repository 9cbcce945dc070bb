"""Do labelled intervals keep their coverage when `main` looks after every round of labels, under the
union bound over its four looks and under the spending rule (issue 47)? Many label draws on one
policy, each certified look after look as `main` does until its stopping rule says stop
(steps.main.labels: decided, or futile); coverage of the policy's deployment truth per family at each look reached
and at the look main stopped at, and the widths (a benchmark may read the truth: it grades and plays
the expert).

    python benchmarks/label_looks.py [--worlds SEED:SPEC ...] [--reps 200] [--workers 2] [--out DIR]

Per world (built once under --cache): the diagnostic's correction, the `corrected-kl005-s1200` recipe
trained on the world's reward model minus it (main's round-1 champion recipe, seed 0), its deployment
truth per family (the oracle, 8 samples on each of 1000 fresh prompts per family). Each replication r:
50 label requests per family drawn as label-requests draws them (seed r), the world's expert labels on
them, and certify's evidence drawn with seed r (its policy samples, bootstrap and folds); then certify's
estimate (evidence/certify.py, with the reward model and the correction, as main's round 1 certifies)
from the first 20, 30, 40, 50 labels per family, with CertifyConfig(label_looks=4) (`union`) and with
label_spending=steps.main.labels.SPENDING at that look (`spending`): the same labels and evidence, only
the rule differs (each rule stops on its own intervals).
Writes every replication to --out/<world>.jsonl (a rerun continues); prints per world and rule the
coverage per family and look, and last lines `coverage_min_stopped: X` (the lowest family coverage at
main's stopping look over worlds and rules), `width_ratio_look1: Y` (spending's mean family width
over union's at look 1) and `labels_at_stop_ratio: Z` (spending's mean labels per family where main
stopped, over union's).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from multiprocessing import get_context

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.certify_accuracy import fresh_prompts  # noqa: E402
from benchmarks.reward_repair import WorldRun  # noqa: E402
from rlhf_mlflow.core import model as M  # noqa: E402
from rlhf_mlflow.core import records as D  # noqa: E402
from rlhf_mlflow.core import vocab as V  # noqa: E402
from rlhf_mlflow.core.own_models import open_policy, open_reward_model  # noqa: E402
from rlhf_mlflow.core.reward_wrapper import load_wrapper  # noqa: E402
from rlhf_mlflow.core.world_paths import WorldPaths  # noqa: E402
from rlhf_mlflow.decisions.certify import CertifyConfig, aggregate, estimate_families  # noqa: E402
from rlhf_mlflow.evidence.certify_evidence import families_evidence, labelled_scores  # noqa: E402
from rlhf_mlflow.evidence.label_requests import draw_requests  # noqa: E402
from rlhf_mlflow.steps.main.labels import ROUNDS, SPENDING, stop_reason  # noqa: E402
from rlhf_mlflow.world import corruptions as C  # noqa: E402
from rlhf_mlflow.world.annotator import label_requests  # noqa: E402
from rlhf_mlflow.world.build import ensure_world  # noqa: E402
from rlhf_mlflow.world.oracle import Oracle  # noqa: E402

RULES = {"union": lambda look: CertifyConfig(label_looks=len(ROUNDS)),
         "spending": lambda look: CertifyConfig(label_spending=SPENDING, label_look=look)}


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def prepare(seed: int, spec: str, a) -> dict:
    """The world, its corrected champion recipe's policy (trained once, kept under --out) and its truth."""
    root, manifest = ensure_world(a.cache, seed, C.load_spec(spec), a.scale, progress=say)
    h = manifest["world_hash"]
    work = os.path.join(a.out, h)
    meta_path = os.path.join(work, "policy.json")
    if os.path.exists(meta_path):
        return json.load(open(meta_path))
    w = WorldRun(WorldPaths.at(root), work, a.steps_scale)
    wrapper, _ = w.correction(w.world.reward_model, "r0")
    policy, _, _ = w.rl(w.world.reward_model, wrapper, seed=0)
    policy_dir = os.path.join(work, "policy")
    M.save_policy(policy, M.load_policy(w.world.policy)[1], policy_dir)
    truth = Oracle(root).grade_policy(policy, fresh_prompts(1000, 4242, prefix="truth"), n=8)
    meta = {"world": h, "spec": spec, "seed": seed, "root": root, "policy": policy_dir, "correction": wrapper,
            "truth": truth}
    json.dump(meta, open(meta_path, "w"), indent=1)
    say(f"world {h} ({spec}, seed {seed}): policy trained, truth balanced {truth['truth/balanced']:.3f}")
    return meta


def replication(args: tuple[dict, int]) -> dict:
    """One label draw certified as main certifies it, under each rule: look after look (20, 30, 40, 50
    labels per family) until main's stopping rule (stop_reason) says stop; per look each family's interval
    (and the balanced one), whether main stopped there and whether for futility."""
    meta, rep = args
    torch.set_num_threads(1)
    world = WorldPaths.at(meta["root"])
    policy, reference = open_policy(meta["policy"]), open_policy(world.policy)
    rm, wrapper = open_reward_model(world.reward_model), load_wrapper(meta["correction"])
    gold = D.read_jsonl(world.expert_set, labelled=True, scale=D.EXPERT)
    labels = label_requests(world, draw_requests(policy, gold, ROUNDS[-1], seed=rep, prefix=f"rep{rep}"))
    evidence = families_evidence(policy, reference, rm, wrapper, D.group_by_family(gold), CertifyConfig(seed=rep),
                                 torch.Generator().manual_seed(rep))
    out = {"rep": rep, "looks": {}}
    for name, rule in RULES.items():
        for look, k in enumerate(ROUNDS, 1):
            sub = {f: [r for r in labels if r["family"] == f][:k] for f in V.FAMILIES}
            cfg = replace(rule(look), seed=rep)
            rows, draws, ref_draws = estimate_families(evidence, sub, labelled_scores(rm, wrapper, sub), cfg)
            report = {"families": rows, "balanced": aggregate(rows, draws, ref_draws, {f: 1.0 for f in V.FAMILIES}, cfg)}
            keep = ("certifiable", "estimate", "lo", "hi")
            stop = stop_reason(report, k)
            out["looks"][f"{name}/{look}"] = {"decided": bool(stop), "futile": stop == "futile",
                                              **{g: {x: r.get(x) for x in keep} for g, r in
                                                 {**rows, "balanced": report["balanced"]}.items()}}
            if stop:
                break
    return out


def summarise(meta: dict, reps: list[dict]) -> dict:
    """Per rule: coverage per family at each look reached (over the draws that reached it), at main's
    stopping look (the first decided, else the last), how often each look was the stop; mean widths."""
    truth, groups, looks = meta["truth"], [*V.FAMILIES, "balanced"], range(1, len(ROUNDS) + 1)
    covers = lambda row, g: bool(row["certifiable"]) and row["lo"] <= truth[f"truth/{g}"] <= row["hi"]  # noqa: E731
    res = {}
    for name in RULES:
        per = {g: {"stopped": [], **{look: [] for look in looks}} for g in groups}
        width = {look: [] for look in looks}
        stops = []
        for rep in reps:
            rows = [rep["looks"][f"{name}/{look}"] for look in looks if f"{name}/{look}" in rep["looks"]]
            stop = next((i for i, r in enumerate(rows) if r["decided"]), len(rows) - 1)
            stops.append(stop + 1)
            for look, r in enumerate(rows, 1):
                for g in groups:
                    per[g][look].append(covers(r[g], g))
                width[look] += [r[f]["hi"] - r[f]["lo"] for f in V.FAMILIES if r[f]["certifiable"]]
            for g in groups:
                per[g]["stopped"].append(covers(rows[stop][g], g))
        res[name] = {"coverage": {g: {str(k): (float(np.mean(v)) if v else None) for k, v in per[g].items()}
                                  for g in groups},
                     "reached": {str(look): len(width[look]) // len(V.FAMILIES) for look in looks},
                     "width": {str(k): float(np.mean(v)) if v else None for k, v in width.items()},
                     "stop_looks": {str(k): stops.count(k) for k in sorted(set(stops))},
                     "labels_at_stop": float(np.mean([ROUNDS[k - 1] for k in stops]))}
    return res


def show(meta: dict, res: dict, n: int) -> None:
    print(f"\nworld {meta['world']} ({meta['spec']}, seed {meta['seed']}): {n} label draws, truth balanced "
          f"{meta['truth']['truth/balanced']:.3f}")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for name, r in res.items():
        print(f"\n{name}: main stopped at look {r['stop_looks']} (labels per family at the stop: "
              f"{r['labels_at_stop']:.1f} on average); mean family width per look "
              + ", ".join(f"{k}: {v:.3f}" for k, v in r["width"].items() if v is not None))
        print("| group | " + " | ".join(f"look {k} ({r['reached'][str(k)]})" for k in range(1, len(ROUNDS) + 1))
              + " | stopped |")
        print("|---" * (len(ROUNDS) + 2) + "|")
        for g, c in r["coverage"].items():
            print(f"| {g} | " + " | ".join(fmt(c[str(k)]) for k in range(1, len(ROUNDS) + 1)) + f" | {fmt(c['stopped'])} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", nargs="+", default=["33:benchmarks/specs/missed_pair.json"], help="SEED:SPEC (default, clean or a spec file)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--scale", default="full")
    ap.add_argument("--steps-scale", type=float, default=1.0)
    ap.add_argument("--cache", default="worlds")
    ap.add_argument("--out", default="/tmp/label_looks")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    worst, ratios, stops = [], [], []
    for item in a.worlds:
        seed, spec = item.split(":", 1)
        meta = prepare(int(seed), spec, a)
        path = os.path.join(a.out, f"{meta['world']}.jsonl")
        done = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
        todo = [r for r in range(a.reps) if r not in {d["rep"] for d in done}]
        with get_context("spawn").Pool(a.workers) as pool, open(path, "a") as f:
            for i, rec in enumerate(pool.imap_unordered(replication, [(meta, r) for r in todo]), 1):
                f.write(json.dumps(rec) + "\n")
                f.flush()
                done.append(rec)
                if i % 20 == 0:
                    say(f"world {meta['world']}: {len(done)} of {a.reps} label draws")
        res = summarise(meta, done[:a.reps])
        show(meta, res, min(len(done), a.reps))
        worst += [c["stopped"] for r in res.values() for g, c in r["coverage"].items() if g != "balanced"]
        ratios.append(res["spending"]["width"]["1"] / res["union"]["width"]["1"])
        stops.append(res["spending"]["labels_at_stop"] / res["union"]["labels_at_stop"])
    print(f"\ncoverage_min_stopped: {min(worst):.3f}")
    print(f"width_ratio_look1: {float(np.mean(ratios)):.3f}")
    print(f"labels_at_stop_ratio: {float(np.mean(stops)):.3f}")


if __name__ == "__main__":
    main()
