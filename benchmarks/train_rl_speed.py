"""train_rl speed: the seed-faithful loop vs ours, same config and seeds, in one process.

    python benchmarks/train_rl_speed.py [--steps 200] [--repeats 3] [--world DIR]

Prints steps/s of each loop (median of --repeats), the per-step time split (sample, score,
backward), times of the other steps on the same world, and last `speedup: X.XX` (ours / seed's).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import seed_loop  # noqa: E402
from rlhf_mlflow import data as D  # noqa: E402
from rlhf_mlflow import model as M  # noqa: E402
from rlhf_mlflow import reward_model as R  # noqa: E402
from rlhf_mlflow.evaluate import dev_eval  # noqa: E402
from rlhf_mlflow.runtime import configure_threads  # noqa: E402
from rlhf_mlflow.train_rl import RLConfig, train_rl  # noqa: E402
from rlhf_mlflow.world.build import ensure_world  # noqa: E402


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def split(t: dict, steps: int) -> str:
    return " ".join(f"{k} {1000 * v / steps:.1f}ms" for k, v in t.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--world", default=None, help="world directory (default: the default world, built once)")
    a = ap.parse_args()
    threads = configure_threads()
    world = a.world or ensure_world("worlds", 0, None, "full", progress=print)[0]
    cfg = RLConfig(steps=a.steps, log_every=a.steps, batch_prompts=16, samples_per_prompt=8).resolved(world)
    print(f"world {world}; B=16 G=8, {a.steps} steps, {threads} threads, median of {a.repeats}")
    rates = {"seed": [], "ours": []}
    splits = {"seed": {}, "ours": {}}
    for r in range(a.repeats):
        for name in ("seed", "ours"):
            t = {}
            if name == "seed":
                secs = timed(lambda: seed_loop.train(cfg, t))
            else:
                secs = timed(lambda: train_rl(cfg, timings=t))
            rates[name].append(a.steps / secs)
            splits[name] = t
            print(f"  run {r + 1} {name}: {a.steps / secs:.2f} steps/s ({split(t, a.steps)})", flush=True)
    seed_rate, ours_rate = statistics.median(rates["seed"]), statistics.median(rates["ours"])
    print(f"seed-faithful loop: {seed_rate:.2f} steps/s  [{split(splits['seed'], a.steps)}]")
    print(f"ours:               {ours_rate:.2f} steps/s  [{split(splits['ours'], a.steps)}]")

    policy, ref = M.load_policy(os.path.join(world, "policy"))[0], M.load_policy(os.path.join(world, "policy"))[0]
    rm = R.load_rm(os.path.join(world, "reward_model"))[0]
    dev = D.read_jsonl(os.path.join(world, "data", "prompts_dev.jsonl"))
    gold = D.read_jsonl(os.path.join(world, "data", "gold_calib.jsonl"))
    print(f"dev_eval: {timed(lambda: dev_eval(policy, ref, rm, dev, gold)):.2f}s")
    try:
        from rlhf_mlflow.diagnostic import run_diagnostic
        print(f"diagnostic: {timed(lambda: run_diagnostic(os.path.join(world, 'reward_model'), os.path.join(world, 'policy'), os.path.join(world, 'data', 'prompts_train.jsonl'))):.2f}s")
    except ImportError:
        print("diagnostic: not built yet")
    try:
        from rlhf_mlflow.certify import certify_policy
        print(f"certify: {timed(lambda: certify_policy(policy, ref, gold)):.2f}s")
    except ImportError:
        print("certify: not built yet")
    import tempfile
    from rlhf_mlflow.world.build import build_world
    with tempfile.TemporaryDirectory() as tmp:
        print(f"build_world (test scale): {timed(lambda: build_world(os.path.join(tmp, 'w'), 0, None, 'test')):.2f}s")
    if a.world is None:
        secs = ensure_world("worlds", 0, None, "full")[1]["timings"]["total_s"]
        print(f"build_world (full): {secs:.1f}s, as recorded in its manifest when it was built")
    print(f"speedup: {ours_rate / seed_rate:.2f}")


if __name__ == "__main__":
    main()
