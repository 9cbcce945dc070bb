"""Issue 21: does subtracting what the reward model pays per flagged occurrence (`bonus`, today) instead
of the QA labels' slope (before) cost the champion recipe true quality? Trains corrected-kl005-s1200
with each correction, same seeds, and grades both on fresh prompts (reads the truth: a benchmark may).
With `--watch N`, each run also has the over-optimisation watch every N steps (the arm's correction as
its predictor, as `main` passes the diagnostic's) and the checkpoint the watch picks, the one `main`
registers, is graded beside the last (`best_*` in the output).

    python benchmarks/correction_premium_ab.py [--world D] [--seeds 0,1] [--watch 50] [--out DIR]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.certify_accuracy import fresh_prompts  # noqa: E402
from rlhf_mlflow.core import model as M  # noqa: E402
from rlhf_mlflow.core import records as D  # noqa: E402
from rlhf_mlflow.core import reward_model as R  # noqa: E402
from rlhf_mlflow.core.process import configure_threads  # noqa: E402
from rlhf_mlflow.core.reward_wrapper import load_wrapper  # noqa: E402
from rlhf_mlflow.decisions.correction import fit_corrections, write_wrapper  # noqa: E402
from rlhf_mlflow.evidence.diagnostic import run_diagnostic  # noqa: E402
from rlhf_mlflow.evidence.watch import PolicyWatch as Watch  # noqa: E402
from rlhf_mlflow.training.recipes import CORRECTED  # noqa: E402
from rlhf_mlflow.training.rl_config import load_rl_config  # noqa: E402
from rlhf_mlflow.training.train_rl import train_rl  # noqa: E402
from rlhf_mlflow.steps.build_world import DEFAULT_WORLDS  # noqa: E402
from rlhf_mlflow.world.build import ensure_world  # noqa: E402
from rlhf_mlflow.world.oracle import Oracle  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", help="a built world (default: the default world, built on first use)")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--watch", type=int, default=0, help="watch every N steps and grade its best checkpoint too")
    ap.add_argument("--out", default="outputs/correction_premium_ab")
    a = ap.parse_args()
    configure_threads()
    world = a.world or ensure_world(DEFAULT_WORLDS, progress=print)[0]
    os.makedirs(a.out, exist_ok=True)
    j = lambda *p: os.path.join(world, *p)  # noqa: E731
    diag = run_diagnostic(j("reward_model"), j("policy"), j("data", "prompts_train.jsonl"))
    rules = fit_corrections(diag, D.read_jsonl(j("reward_model", "train.jsonl"), labelled=True))
    print("rules:", [(r["family"], r.get("token"), r["bonus"], r["label_slope"]) for r in rules], flush=True)
    write_wrapper(rules, os.path.join(a.out, "bonus.py"))
    write_wrapper([dict(r, bonus=r["bonus"] if r["label_slope"] is None else r["label_slope"]) for r in rules],
                  os.path.join(a.out, "slope.py"))
    oracle, deploy = Oracle(world), fresh_prompts(400, 10_000, prefix="deploy")
    for seed in [int(s) for s in a.seeds.split(",")]:
        for kind in ("bonus", "slope"):
            t = time.perf_counter()
            wrapper = os.path.join(a.out, f"{kind}.py")
            over = dict(CORRECTED["corrected-kl005-s1200"], seed=seed, reward_wrapper=wrapper)
            cfg = load_rl_config(j("configs", "default.json"), over)
            best, on_watch = {}, None
            if a.watch:
                cfg = load_rl_config(j("configs", "default.json"), dict(over, watch_every=a.watch,
                                                                         watch_gold=j("data", "gold_calib.jsonl")))
                watch = Watch(M.load_policy(cfg.policy_ref)[0], R.load_rm(cfg.reward_model)[0], load_wrapper(wrapper),
                              D.read_jsonl(cfg.watch_gold, labelled=True))

                def on_watch(step, policy, watch=watch, best=best):
                    if watch.observe(step, policy).best:
                        best.update(step=step, policy=copy.deepcopy(policy))
                    return "continue"
            policy = train_rl(cfg, on_watch=on_watch).policy
            truth = oracle.grade_policy(policy, deploy, n=8, seed=1)
            out = {"seed": seed, "correction": kind, "secs": round(time.perf_counter() - t),
                   **{k: round(v, 4) for k, v in truth.items()}}
            if best:
                out["best_step"] = best["step"]
                out.update({f"best_{k}": round(v, 4) for k, v in oracle.grade_policy(best["policy"], deploy, n=8,
                                                                                    seed=1).items()})
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
