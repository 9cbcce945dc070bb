"""How close is certification to the truth? Over several worlds and several policies per world,
compare the certified quality (per family and balanced) with the oracle's true quality on the same
expert prompts, and count refusals.

    python benchmarks/certify_accuracy.py [--worlds 5] [--seed 300] [--steps-scale 1.0]

Per world (bench scale, default corruption spec, a different seed each): the gold-free diagnostic and
its correction are fitted as the pipeline does, then these policies are trained and certified:
reference itself, corrected kl 0.1 / 300 and kl 0.05 / 600 steps, uncorrected kl 0.1 / 300 (it
exploits the shortcuts), and kl 0.02 / 800 (far from the reference: certification should refuse).
The truth is the oracle's mean true quality of each policy's samples on the expert prompts (32 per
prompt), i.e. exactly the quantity certification estimates. Prints MAE, 90%-interval coverage and the
refusal rate, per family and balanced; the last line is `coverage: X.XXX`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from rlhf_mlflow.core import model as M  # noqa: E402
from rlhf_mlflow.core import records as D  # noqa: E402
from rlhf_mlflow.core.process import configure_threads  # noqa: E402
from rlhf_mlflow.decisions import certify as C  # noqa: E402
from rlhf_mlflow.decisions.correction import fit_corrections, write_wrapper  # noqa: E402
from rlhf_mlflow.decisions.diagnostic import run_diagnostic  # noqa: E402
from rlhf_mlflow.training.rl_config import load_rl_config  # noqa: E402
from rlhf_mlflow.training.train_rl import train_rl  # noqa: E402
from rlhf_mlflow.world.build import ensure_world  # noqa: E402
from rlhf_mlflow.world.oracle import Oracle  # noqa: E402

POLICIES = {
    "corrected-kl0.1-s300": ({"kl_coef": 0.1, "steps": 300}, True),
    "corrected-kl0.05-s600": ({"kl_coef": 0.05, "steps": 600}, True),
    "raw-kl0.1-s300": ({"kl_coef": 0.1, "steps": 300}, False),
    "raw-kl0.02-s800": ({"kl_coef": 0.02, "steps": 800}, False),
}


def evaluate_world(seed: int, cache: str, work: str, steps_scale: float) -> list[dict]:
    world, _ = ensure_world(cache, seed, None, "bench", progress=lambda m: print(f"  {m}", flush=True))
    j = lambda *p: os.path.join(world, *p)  # noqa: E731
    oracle = Oracle(world)
    gold_path = j("data", "gold_calib.jsonl")
    gold_prompts = [{k: r[k] for k in ("id", "family", "attrs")} for r in D.read_jsonl(gold_path, labelled=True)]
    diag = run_diagnostic(j("reward_model"), j("policy"), j("data", "prompts_train.jsonl"))
    wrapper = os.path.join(work, f"correction-{seed}.py")
    write_wrapper(fit_corrections(diag, D.read_jsonl(j("reward_model", "train.jsonl"), labelled=True)), wrapper)
    rows = []
    policies = {"reference": j("policy")}
    for name, (ov, corrected) in POLICIES.items():
        ov = dict(ov, steps=max(1, int(ov["steps"] * steps_scale)), seed=seed)
        if corrected:
            ov["reward_wrapper"] = wrapper
        cfg = load_rl_config(j("configs", "default.json"), ov)
        out = os.path.join(work, f"{seed}-{name}")
        M.save_policy(train_rl(cfg).policy, M.default_config(), out)
        policies[name] = out
    for name, path in policies.items():
        t = time.perf_counter()
        rep = C.certify(path, j("policy"), gold_path, rm_dir=j("reward_model"), correction=wrapper, diagnostic=diag)
        secs = time.perf_counter() - t
        truth = oracle.grade_policy(M.load_policy(path)[0], gold_prompts, n=32)
        for f, r in list(rep["families"].items()) + [("balanced", rep["balanced"])]:
            rows.append({"world": seed, "policy": name, "family": f, "truth": truth[f"truth/{f}"],
                         "certifiable": r["certifiable"], "estimate": r["estimate"], "lo": r["lo"], "hi": r["hi"],
                         "ess": r.get("ess"), "seconds": secs})
        b = rep["balanced"]
        shown = f"{b['estimate']:.3f} [{b['lo']:.3f}, {b['hi']:.3f}]" if b["certifiable"] else f"refused ({b['reason']})"
        print(f"  world {seed} {name:24s} truth {truth['truth/balanced']:.3f}  certified {shown}  ({secs:.1f}s)",
              flush=True)
    return rows


def summarise(rows: list[dict]) -> dict:
    out = {}
    for level, keep in (("family", lambda r: r["family"] != "balanced"), ("balanced", lambda r: r["family"] == "balanced")):
        sel = [r for r in rows if keep(r)]
        given = [r for r in sel if r["certifiable"]]
        err = np.array([r["estimate"] - r["truth"] for r in given])
        cover = np.array([r["lo"] <= r["truth"] <= r["hi"] for r in given])
        out[level] = {"n": len(sel), "given": len(given), "refusal_rate": 1 - len(given) / max(len(sel), 1),
                      "mae": float(np.abs(err).mean()) if len(err) else float("nan"),
                      "bias": float(err.mean()) if len(err) else float("nan"),
                      "coverage": float(cover.mean()) if len(cover) else float("nan"),
                      "width": float(np.mean([r["hi"] - r["lo"] for r in given])) if given else float("nan")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=300, help="first world seed")
    ap.add_argument("--cache", default="worlds/bench")
    ap.add_argument("--work", default="outputs/certify_accuracy")
    ap.add_argument("--steps-scale", type=float, default=1.0)
    a = ap.parse_args()
    configure_threads()
    os.makedirs(a.work, exist_ok=True)
    t0 = time.perf_counter()
    rows = []
    for seed in range(a.seed, a.seed + a.worlds):
        print(f"world seed {seed}", flush=True)
        rows += evaluate_world(seed, a.cache, a.work, a.steps_scale)
    s = summarise(rows)
    print(f"\n{'level':9s} {'cells':>6s} {'given':>6s} {'refused':>8s} {'MAE':>7s} {'bias':>7s} {'coverage':>9s} {'width':>7s}")
    for level, v in s.items():
        print(f"{level:9s} {v['n']:6d} {v['given']:6d} {v['refusal_rate']:8.2f} {v['mae']:7.3f} {v['bias']:+7.3f} "
              f"{v['coverage']:9.3f} {v['width']:7.3f}")
    far = [r for r in rows if r["policy"] == "raw-kl0.02-s800" and r["family"] == "balanced"]
    print(f"far policy (kl 0.02 / 800) refused in {sum(not r['certifiable'] for r in far)}/{len(far)} worlds")
    print(f"total {time.perf_counter() - t0:.0f}s")
    given = [r for r in rows if r["certifiable"]]
    print(f"coverage: {np.mean([r['lo'] <= r['truth'] <= r['hi'] for r in given]):.3f}")


if __name__ == "__main__":
    main()
