"""Replay the seed's figures on the default world and print ours beside the seed's.

    python benchmarks/replay_seed.py [--world DIR] [--steps-scale 1.0]

Builds (or reuses) the default world, trains the seed's five historical recipes plus corrected-reward
recipes (the world's true dune/ember bonuses subtracted: a benchmark may read the truth), and prints
the SPEC's seed table with our numbers, then each run's oracle true quality per family.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from rlhf_mlflow.core import model as M  # noqa: E402
from rlhf_mlflow.core import records as D  # noqa: E402
from rlhf_mlflow.core import reward_model as R  # noqa: E402
from rlhf_mlflow.core import vocab as V  # noqa: E402
from rlhf_mlflow.core.process import configure_threads  # noqa: E402
from rlhf_mlflow.training.evaluate import dev_eval, family_probe, first_per_family  # noqa: E402
from rlhf_mlflow.training.recipes import CORRECTED, SEED_HISTORY  # noqa: E402
from rlhf_mlflow.training.rl_config import load_rl_config  # noqa: E402
from rlhf_mlflow.training.train_rl import train_rl  # noqa: E402
from rlhf_mlflow.world import corruptions as C  # noqa: E402
from rlhf_mlflow.world.build import ensure_world  # noqa: E402
from rlhf_mlflow.world.oracle import Oracle  # noqa: E402


def true_bonus_wrapper(spec):
    """Subtract the world's true corruption bonuses (benchmark only: it reads the secret spec)."""
    def transform(records, tokens, rewards):
        b = C.bonus(spec, D.prompts_tensor(records), torch.tensor([V.encode_response(t) for t in tokens]))
        return (torch.tensor(rewards) - b).tolist()
    return transform


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", default=None, help="world directory (default: build or reuse the default world)")
    ap.add_argument("--steps-scale", type=float, default=1.0, help="multiply every recipe's steps (quick looks)")
    ap.add_argument("--json", default=None, help="also write all figures to this JSON file")
    a = ap.parse_args()
    configure_threads()
    t_start = time.perf_counter()
    world = a.world or ensure_world("worlds", 0, None, "full", progress=print)[0]
    j = lambda *p: os.path.join(world, *p)  # noqa: E731
    ref = M.load_policy(j("policy"))[0]
    rm = R.load_rm(j("reward_model"))[0]
    dev, gold = D.read_jsonl(j("data", "prompts_dev.jsonl")), D.read_jsonl(j("data", "gold_calib.jsonl"))
    probe_prompts = first_per_family(D.read_jsonl(j("data", "prompts_train.jsonl")))
    oracle = Oracle(world)
    fig: dict[str, dict] = {}

    def measure(name, policy, seconds=0.0):
        d = dev_eval(policy, ref, rm, dev, gold).metrics
        p = family_probe(policy, ref, rm, probe_prompts, ("pa", "he"))
        t = oracle.grade_policy(policy, probe_prompts, n=2)
        fig[name] = {"dev": d, "probe": p, "truth": t, "seconds": seconds}
        print(f"  {name}: dev proxy {d['proxy_mean']:.3f}, dev KL {d['kl_mean']:.2f}, truth "
              f"{t['truth/balanced']:.3f} ({seconds:.0f}s)", flush=True)

    measure("reference", ref)
    recipes = [(n, ov, None) for n, (ov, _) in SEED_HISTORY.items()]
    recipes += [(n, ov, true_bonus_wrapper(oracle.spec)) for n, ov in CORRECTED.items()]
    for name, ov, wrapper in recipes:
        if a.steps_scale != 1.0:
            ov = dict(ov, steps=max(1, int(ov["steps"] * a.steps_scale)))
        cfg = load_rl_config(j("configs", "default.json"), ov)
        res = train_rl(cfg, wrapper=wrapper)
        measure(name, res.policy, res.seconds)
    print_table(fig)
    print(f"total {time.perf_counter() - t_start:.0f}s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(fig, f, indent=1)


def print_table(fig: dict) -> None:
    g = lambda run, part, key: fig.get(run, {}).get(part, {}).get(key, float("nan"))  # noqa: E731
    clean = ["anvil", "birch", "cobalt", "fjord"]
    ref_r = [g("reference", "dev", f"rm_gold_pearson/{f}") for f in clean]
    d8 = "default-s800"
    rows = [
        ("reference dev proxy mean / RM-gold pooled Pearson", "0.305 / 0.231",
         f"{g('reference', 'dev', 'proxy_mean'):.3f} / {g('reference', 'dev', 'rm_gold_pearson'):.3f}"),
        ("RM-gold Pearson clean families / dune / ember", "0.43-0.58 / 0.08 / 0.35",
         f"{min(ref_r):.2f}-{max(ref_r):.2f} / {g('reference', 'dev', 'rm_gold_pearson/dune'):.2f} / "
         f"{g('reference', 'dev', 'rm_gold_pearson/ember'):.2f}"),
        ("default-s800: dev proxy, dev KL", "0.666, 1.77",
         f"{g(d8, 'dev', 'proxy_mean'):.3f}, {g(d8, 'dev', 'kl_mean'):.2f}"),
        ("default-s800 balanced: dune pa, ember he (reference)", "3.83 / 3.49 (0.30 / 0.54)",
         f"{g(d8, 'probe', 'count_pa/dune'):.2f} / {g(d8, 'probe', 'count_he/ember'):.2f} "
         f"({g('reference', 'probe', 'count_pa/dune'):.2f} / {g('reference', 'probe', 'count_he/ember'):.2f})"),
        ("default-s800 family KL dune / ember / others", "12.0 / 7.3 / 0.7-1.0",
         f"{g(d8, 'probe', 'kl/dune'):.1f} / {g(d8, 'probe', 'kl/ember'):.1f} / "
         f"{min(g(d8, 'probe', f'kl/{f}') for f in clean):.2f}-{max(g(d8, 'probe', f'kl/{f}') for f in clean):.2f}"),
        ("kl002-s1500: dune pa / ember he; dev proxy; dev KL", "6.36 / 7.99; 1.127; 11.9",
         f"{g('kl002-s1500', 'probe', 'count_pa/dune'):.2f} / {g('kl002-s1500', 'probe', 'count_he/ember'):.2f}; "
         f"{g('kl002-s1500', 'dev', 'proxy_mean'):.3f}; {g('kl002-s1500', 'dev', 'kl_mean'):.1f}"),
        ("kl05-s800: dev proxy, dev KL", "0.391, 0.121",
         f"{g('kl05-s800', 'dev', 'proxy_mean'):.3f}, {g('kl05-s800', 'dev', 'kl_mean'):.3f}"),
        ("corrected, kl 0.1, 800: dev proxy, dev KL, true balanced", "0.456, 0.875, 0.465",
         f"{g('corrected-s800', 'dev', 'proxy_mean'):.3f}, {g('corrected-s800', 'dev', 'kl_mean'):.3f}, "
         f"{g('corrected-s800', 'truth', 'truth/balanced'):.3f}"),
        ("corrected, kl 0.05, 1200: true balanced", "0.634",
         f"{g('corrected-kl005-s1200', 'truth', 'truth/balanced'):.3f}"),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"\n{'figure':<{w}}  {'seed':<26}  ours")
    for name, seed, ours in rows:
        print(f"{name:<{w}}  {seed:<26}  {ours}")
    print("\ntrue quality (oracle) per family on balanced prompts")
    print(f"{'run':<24}" + "".join(f"{f:>8}" for f in V.FAMILIES) + f"{'balanced':>10}")
    for run, v in fig.items():
        t = v["truth"]
        print(f"{run:<24}" + "".join(f"{t.get('truth/' + f, float('nan')):>8.3f}" for f in V.FAMILIES)
              + f"{t['truth/balanced']:>10.3f}")


if __name__ == "__main__":
    main()
