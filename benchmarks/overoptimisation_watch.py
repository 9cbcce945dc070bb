"""Does the over-optimisation watch warn before a family's true quality falls, and stay quiet on clean
families? train_rl with the watch on (the watch's defaults, watch_every 50), the oracle grading the
policy at every watch point (a benchmark may read the truth; the watch never does).

    python benchmarks/overoptimisation_watch.py [--worlds DIR ...] [--steps-scale 1] [--out DIR]

Per world: the seed's recipes (kl002-s1500 is the far-drifting one: kl 0.02, 1500 steps) and
corrected-s800 (the diagnostic's correction: /tmp/cov2/work/<world hash>/correction.py when cached,
else fitted here). Per family and run:
  - over-optimised: the truth falls more than 0.05 below its best watch point; then the lead is
    (step of the true peak) - (step the watch fired), negative = after the peak, and the lead to the
    drop is (first step the truth is 0.05 below its peak so far) - (step fired);
  - clean: the truth never falls 0.05 below its peak; a watch alarm there is a false alarm.
stop: the run would end at its first alarm and register the best estimated balanced point so far;
stop_truth_gain = its balanced truth - the balanced truth at the end (mean over runs).
Results per run go to --out (runs already there are not trained again). Last lines:
`watch_lead_steps: X` (median over over-optimised families it fired on), `watch_false_alarm: Y`
(fraction of clean families it fired on), `stop_truth_gain: Z`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rlhf_mlflow.core import model as M  # noqa: E402
from rlhf_mlflow.core import records as D  # noqa: E402
from rlhf_mlflow.core import reward_model as R  # noqa: E402
from rlhf_mlflow.core.reward_wrapper import load_wrapper  # noqa: E402
from rlhf_mlflow.core.world_paths import WorldPaths  # noqa: E402
from rlhf_mlflow.decisions import watch as W  # noqa: E402
from rlhf_mlflow.evidence.watch import PolicyWatch  # noqa: E402
from rlhf_mlflow.training.recipes import CORRECTED, SEED_HISTORY, scaled  # noqa: E402
from rlhf_mlflow.training.rl_config import RLConfig, load_rl_config  # noqa: E402
from rlhf_mlflow.training.train_rl import train_rl  # noqa: E402
from rlhf_mlflow.world.build import ensure_world  # noqa: E402
from rlhf_mlflow.world.oracle import Oracle  # noqa: E402

DROP = 0.05
SEEN_WITHIN = 50
"""An over-optimised family is seen when the watch fires or stops vouching within this many steps of its
truth falling DROP below its peak (issue 33)."""
OVER = 0.10
"""... and fooled when, from that drop on, a vouched-for estimate stands more than this above the truth."""
WATCH_EVERY = 50
GRADE_PER_FAMILY, GRADE_N = 250, 2


def correction_for(world: WorldPaths, work: str) -> str:
    """The diagnostic's correction for this world: cached under `work`, else the diagnostic run and fitted."""
    path = os.path.join(work, f"{os.path.basename(world.root)}_correction.py")
    if not os.path.exists(path):
        from rlhf_mlflow.decisions.correction import fit_corrections, write_wrapper
        from rlhf_mlflow.evidence.diagnostic import run_diagnostic
        diag = run_diagnostic(world.reward_model, world.policy, world.prompts_train)
        write_wrapper(fit_corrections(diag, D.read_jsonl(world.qa, labelled=True)), path)
    return path


def grading_prompts(world: WorldPaths) -> list[dict]:
    """The first GRADE_PER_FAMILY training prompts of each family: the truth on a balanced mix."""
    out: list[dict] = []
    for rows in D.group_by_family(D.read_jsonl(world.prompts_train)).values():
        out += rows[:GRADE_PER_FAMILY]
    return out


def run_one(world: WorldPaths, overrides: dict, correction: str | None, watch_every: int, early_every: int) -> dict:
    """Train with the watch (its predictor corrected by `correction`, the diagnostic's as in main, or
    by the run's own reward wrapper when None: a user who runs the watch alone) and the oracle at every
    watch point; the points as plain lists."""
    cfg = load_rl_config(world.config, {**overrides, "watch_every": watch_every, "watch_early_every": early_every,
                                        "watch_gold": world.expert_set, "watch_correction": correction})
    watch = PolicyWatch(M.load_policy(cfg.policy_ref)[0], R.load_rm(cfg.reward_model)[0],
                        load_wrapper(cfg.watch_correction or cfg.reward_wrapper),
                        D.read_jsonl(cfg.watch_gold, labelled=True))
    oracle, prompts = Oracle(world.root), grading_prompts(world)
    truth: list[dict] = []

    def on_watch(step, policy):
        watch.observe(step, policy)
        with torch.no_grad():
            truth.append(oracle.grade_policy(policy, prompts, GRADE_N, seed=1234))
        return "continue"

    train_rl(cfg, on_watch=on_watch)
    pts = watch.points
    return {"steps": [p.step for p in pts], "estimate": [p.estimate for p in pts], "se": [p.se for p in pts],
            "kl": [p.kl for p in pts], "method": [p.method for p in pts], "fired": watch.fired, "why": watch.why,
            "vouched": [p.vouched for p in pts], "reason": [p.reason for p in pts],
            "truth": [{k.split("/")[1]: v for k, v in t.items()} for t in truth]}


def stop_best(r: dict) -> int:
    """The step early_stop=stop would register (Watch.best_step up to the first alarm, or the end)."""
    first = min(r["fired"].values(), default=r["steps"][-1])
    vouched = r.get("vouched") or [{} for _ in r["steps"]]
    pts = [W.WatchPoint(s, e, se, {}, kl, {}, m, vouched=v) for s, e, se, kl, m, v in
           zip(r["steps"], r["estimate"], r["se"], r["kl"], r["method"], vouched) if s <= first]
    return W.best_step(pts) or r["steps"][-1]


def family_outcome(r: dict, f: str) -> dict:
    steps, t = r["steps"], np.array([x[f] for x in r["truth"]])
    peak = int(np.argmax(t))
    running = np.maximum.accumulate(t)
    below = np.nonzero(running - t > DROP)[0]
    out = {"family": f, "true_peak_step": steps[peak], "fired": r["fired"].get(f),
           "overoptimised": bool(len(below)), "drop_step": steps[below[0]] if len(below) else None}
    if out["fired"] is not None:
        out["lead"] = out["true_peak_step"] - out["fired"]
        if out["drop_step"] is not None:
            out["lead_to_drop"] = out["drop_step"] - out["fired"]
    vouched = [v.get(f, True) for v in r.get("vouched") or [{} for _ in steps]]
    unvouched = [s for s, v in zip(steps, vouched) if not v]
    out["unvouched"] = unvouched[0] if unvouched else None
    if out["overoptimised"]:  # the watch saw it: fired, or stopped vouching, within SEEN_WITHIN of the drop
        seen = [x for x in (out["fired"], out["unvouched"]) if x is not None]
        out["seen"] = bool(seen) and min(seen) <= out["drop_step"] + SEEN_WITHIN
        est = [e[f] for e in r["estimate"]]
        over = [s for s, e, v, tt in zip(steps, est, vouched, t) if s >= out["drop_step"] and v and e > tt + OVER]
        out["over_truth_at"] = over
    return out


def summarise(results: dict[str, dict]) -> None:
    leads, to_drop, missed, clean, false_alarms, gains, fooled, unseen = [], [], [], 0, 0, [], [], []
    xs, ys, within = [], [], []
    for name, r in results.items():
        for f in r["fired"].keys() | r["truth"][0].keys() - {"balanced"}:
            o = family_outcome(r, f)
            print(f"  {name:40s} {f:7s} true peak @{o['true_peak_step']:5d}  0.05 drop @{o['drop_step']}  "
                  f"fired @{o['fired']}  unvouched @{o['unvouched']}"
                  + (f" ({r['why'][f]})" if f in r.get("why", {}) else ""))
            if o["overoptimised"] and not o["seen"]:
                unseen.append((name, f))
            if o["overoptimised"] and (not o["seen"] or o["over_truth_at"]):
                fooled.append((name, f, "unseen" if not o["seen"] else f"vouched > truth + {OVER} at "
                               f"{o['over_truth_at'][:3]}"))
            if o["overoptimised"]:
                if o["fired"] is None:
                    missed.append((name, f))
                else:
                    leads.append(o["lead"])
                    to_drop.append(o["lead_to_drop"])
            else:
                clean += 1
                false_alarms += o["fired"] is not None
            keep = [v.get(f, True) for v in r.get("vouched") or [{} for _ in r["steps"]]]
            e = [p[f] for p, k in zip(r["estimate"], keep) if k]
            t = [p[f] for p, k in zip(r["truth"], keep) if k]
            xs += e
            ys += t
            if np.std(e) > 0 and np.std(t) > 0:
                within.append(float(np.corrcoef(e, t)[0, 1]))
        truth_b = {s: t["balanced"] for s, t in zip(r["steps"], r["truth"])}
        kept = stop_best(r)
        gains.append(truth_b[kept] - r["truth"][-1]["balanced"])
        print(f"  {name:40s} stop: kept @{kept} truth {truth_b[kept]:.3f} vs end {r['truth'][-1]['balanced']:.3f}")
    print(f"over-optimised families: {len(leads) + len(missed)} (alarm fired on {len(leads)}; no alarm on "
          f"{len(missed)}: {missed}; of those, seen by no longer vouching: {len(missed) - len(unseen)})")
    print(f"watch_lead_to_drop_steps: {statistics.median(to_drop) if to_drop else float('nan')} "
          "(median steps before the truth fell 0.05 below its peak)")
    print(f"corr(watch/<family>, truth/<family>): pooled {np.corrcoef(xs, ys)[0, 1]:.3f}, "
          f"median within run and family {statistics.median(within):.3f} over {len(within)}")
    print(f"watch_lead_steps: {statistics.median(leads) if leads else float('nan')}")
    print(f"watch_false_alarm: {false_alarms / max(clean, 1):.3f} ({false_alarms} of {clean} clean families)")
    print(f"stop_truth_gain: {float(np.mean(gains)):+.4f}")
    print(f"fooled: {fooled}")
    print(f"watch_fooled: {len(fooled)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", nargs="+", help="built worlds (default: the default world, built if missing)")
    ap.add_argument("--steps-scale", type=float, default=1.0)
    ap.add_argument("--recipes", nargs="+", default=list(SEED_HISTORY) + ["corrected-s800"])
    ap.add_argument("--watch-every", type=int, default=WATCH_EVERY)
    ap.add_argument("--watch-early-every", type=int, default=RLConfig().watch_early_every,
                    help="watch this often before the first --watch-every step (0: no dense start)")
    ap.add_argument("--watch-correction", choices=("diagnostic", "none"), default="diagnostic",
                    help="the watch's predictor: corrected by the diagnostic's correction (as in main), or by "
                         "nothing but the run's own reward wrapper (a user who runs the watch alone)")
    ap.add_argument("--out", default="/tmp/overopt_watch")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = {}
    for root in args.worlds or [ensure_world("worlds", progress=print)[0]]:
        world = WorldPaths.at(root)
        for name in args.recipes:
            correction = correction_for(world, args.out)
            ov = dict(SEED_HISTORY[name][0]) if name in SEED_HISTORY else \
                {**CORRECTED[name], "reward_wrapper": correction}
            key = f"{os.path.basename(root)}/{name}@{args.steps_scale:g}/w{args.watch_every}e{args.watch_early_every}" \
                + ("/bare" if args.watch_correction == "none" else "")
            path = os.path.join(args.out, key.replace("/", "_") + ".json")
            if not os.path.exists(path):
                print(f"training {key}", flush=True)
                with open(path + ".tmp", "w") as fh:
                    json.dump(run_one(world, scaled(ov, args.steps_scale),
                                      correction if args.watch_correction == "diagnostic" else None,
                                      args.watch_every, args.watch_early_every), fh)
                os.replace(path + ".tmp", path)
            with open(path) as fh:
                results[key] = json.load(fh)
    summarise(results)


if __name__ == "__main__":
    main()
