"""train_rl speed: the seed-faithful loop vs ours, same config and seeds, in one process.

    python benchmarks/train_rl_speed.py [--steps 200] [--repeats 3] [--world DIR]
    python benchmarks/train_rl_speed.py --watch-every 50 [--steps 400] [--repeats 3] [--world DIR]

Runs the seed-faithful loop, ours, and ours in one process on one thread alternately (--repeats times
each, B=16 x G=8) and prints steps/s of each (median),
the per-step time split (sample, score, backward; mean over repeats), the load average before and
after (the ratio is robust to a shared machine, absolute times are not), the other steps' times on the
same world, a markdown table for the README, and last `speedup: X.XX` (ours / seed-faithful).
With --watch-every N: train_rl without and with the over-optimisation watch every N steps (the expert
set, the watch's defaults), alternately, as it runs (two threads: with its partner process) and held to
one process; last `watch_slowdown: X.XX` (seconds with / without, median of the per-repeat ratios,
the run as it runs by default).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import seed_loop  # noqa: E402
from rlhf_mlflow.core import model as M  # noqa: E402
from rlhf_mlflow.core import records as D  # noqa: E402
from rlhf_mlflow.core import reward_model as R  # noqa: E402
from rlhf_mlflow.core.process import configure_threads  # noqa: E402
from rlhf_mlflow.training import two_process_step as partner  # noqa: E402
from rlhf_mlflow.training.evaluate import dev_eval  # noqa: E402
from rlhf_mlflow.training.rl_config import RLConfig  # noqa: E402
from rlhf_mlflow.training.train_rl import train_rl  # noqa: E402
from rlhf_mlflow.world.build import build_world, ensure_world  # noqa: E402

PHASES = ("sample", "score", "backward")


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def one_process(cfg: RLConfig, t: dict) -> None:
    """Ours on one thread: no partner process (what main's and the sweep's side-by-side workers run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_rl(cfg, timings=t)
    finally:
        torch.set_num_threads(threads)


LOOPS = {"seed": "seed-faithful loop", "ours": "train_rl", "ours_1p": "train_rl, one process"}


def compare_loops(cfg: RLConfig, repeats: int) -> dict[str, dict]:
    """Alternate the loops; per loop, steps/s of each repeat and the mean per-step split (ms)."""
    out = {name: {"rates": [], "split": dict.fromkeys(PHASES, 0.0)} for name in LOOPS}
    warm = replace(cfg, steps=3, log_every=3)  # one-time costs (lazy library init, first allocations) off the clock
    seed_loop.train(warm)
    train_rl(warm)
    for r in range(repeats):
        for name, run in (("seed", seed_loop.train), ("ours", lambda c, t: train_rl(c, timings=t)),
                          ("ours_1p", one_process)):
            t: dict[str, float] = {}
            secs = timed(lambda: run(cfg, t))
            out[name]["rates"].append(cfg.steps / secs)
            for k in PHASES:
                out[name]["split"][k] += 1000 * t[k] / cfg.steps / repeats
            print(f"  run {r + 1} {name}: {cfg.steps / secs:6.2f} steps/s  "
                  + " ".join(f"{k} {1000 * t[k] / cfg.steps:.1f}ms" for k in PHASES), flush=True)
    return out


def compare_watch(cfg: RLConfig, repeats: int, every: int, correction: str | None = None) -> dict[str, list[float]]:
    """Per setting (with the partner, one process): the ratio of train_rl's seconds with the watch on
    (every `every` steps, from step 0) to without, per repeat, each pair run back to back; and
    (", inside") the watched run's seconds over the same run's seconds outside the watch, which a
    drifting machine moves less. `correction` (a correction file): the watch's predictor and the
    shortcuts it counts, as in `main`; the watch's dense start is RLConfig's default."""
    from rlhf_mlflow.core.reward_wrapper import load_wrapper
    from rlhf_mlflow.decisions.watch import Watch
    world = os.path.dirname(os.path.dirname(cfg.prompt_file))
    gold = D.read_jsonl(os.path.join(world, "data", "gold_calib.jsonl"), labelled=True)
    watched = replace(cfg, watch_every=every, watch_gold=os.path.join(world, "data", "gold_calib.jsonl"))
    train_rl(replace(cfg, steps=3, log_every=3))
    out: dict[str, list[float]] = {"partner": [], "one process": [], "partner, inside": [], "one process, inside": []}
    for r in range(repeats):
        for name in ("partner", "one process"):
            def run(c, on_watch=None):
                if name == "one process":
                    torch.set_num_threads(1)
                try:
                    return timed(lambda: train_rl(c, on_watch=on_watch))
                finally:
                    torch.set_num_threads(configure_threads())
            watch = Watch(M.load_policy(cfg.policy_ref)[0], R.load_rm(cfg.reward_model)[0], load_wrapper(correction),
                          gold)
            inside = [0.0]

            def on_watch(step, policy):
                inside[0] -= time.perf_counter()
                watch.observe(step, policy)
                inside[0] += time.perf_counter()
                return "continue"
            off = run(cfg)
            on = run(watched, on_watch)
            out[name].append(on / off)
            out[name + ", inside"].append(on / (on - inside[0]))
            print(f"  run {r + 1} {name}: {cfg.steps / off:.2f} steps/s without the watch, {cfg.steps / on:.2f} with "
                  f"({len(watch.points)} watch points, {inside[0]:.2f} s in them: {on / (on - inside[0]):.3f} of the "
                  f"same run without them): ratio {on / off:.3f}; {load()}", flush=True)
    return out


def other_steps(world: str) -> dict[str, float | None]:
    """Seconds for dev_eval, the diagnostic, certify and a test-scale world build on `world`."""
    j = lambda *p: os.path.join(world, *p)  # noqa: E731
    policy, ref = M.load_policy(j("policy"))[0], M.load_policy(j("policy"))[0]
    rm = R.load_rm(j("reward_model"))[0]
    dev, gold = D.read_jsonl(j("data", "prompts_dev.jsonl")), D.read_jsonl(j("data", "gold_calib.jsonl"))
    out: dict[str, float | None] = {"dev_eval": timed(lambda: dev_eval(policy, ref, rm, dev, gold))}
    try:
        from rlhf_mlflow.decisions.diagnostic import run_diagnostic
        out["diagnostic"] = timed(lambda: run_diagnostic(j("reward_model"), j("policy"),
                                                         j("data", "prompts_train.jsonl")))
    except ImportError:
        out["diagnostic"] = None
    try:
        from rlhf_mlflow.decisions.certify import certify
        out["certify"] = timed(lambda: certify(j("policy"), j("policy"), j("data", "gold_calib.jsonl"),
                                               rm_dir=j("reward_model")))
    except ImportError:
        out["certify"] = None
    with tempfile.TemporaryDirectory() as tmp:
        out["build_world (test scale)"] = timed(lambda: build_world(os.path.join(tmp, "w"), 0, None, "test"))
    return out


def table(loops: dict[str, dict], steps: int, threads: int, others: dict[str, float | None]) -> str:
    """The README's performance table (markdown)."""
    rows = ["| | steps/s | ms/step | sample | score | backward |", "|---|---:|---:|---:|---:|---:|"]
    for name, label in LOOPS.items():
        rate, s = statistics.median(loops[name]["rates"]), loops[name]["split"]
        rows.append(f"| {label} | {rate:.1f} | {1000 / rate:.1f} | " + " | ".join(f"{s[k]:.1f}" for k in PHASES) + " |")
    speedup = statistics.median(loops["ours"]["rates"]) / statistics.median(loops["seed"]["rates"])
    rows.append(f"\nB=16 x G=8, {steps} steps, median of {len(loops['ours']['rates'])}, {threads} threads (train_rl: "
                f"{'with' if partner.available(threads, 16) else 'without'} its partner process); times in ms per "
                f"step; speedup {speedup:.2f}x.\n")
    rows += ["| step | seconds |", "|---|---:|"]
    rows += [f"| {k} | {'n/a' if v is None else f'{v:.2f}'} |" for k, v in others.items()]
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--world", default=None, help="world directory (default: the default world, built once)")
    ap.add_argument("--watch-every", type=int, default=0, help="compare train_rl with and without the watch")
    ap.add_argument("--watch-correction", help="with --watch-every: a correction file (the diagnostic's, as main "
                                               "passes it): the watch's predictor and the shortcuts it counts")
    a = ap.parse_args()
    threads = configure_threads()
    world = a.world or ensure_world("worlds", 0, None, "full", progress=print)[0]
    cfg = RLConfig(steps=a.steps, log_every=a.steps, batch_prompts=16, samples_per_prompt=8).resolved(world)
    if a.watch_every:
        print(f"world {world}; B=16 G=8, {a.steps} steps, watch every {a.watch_every}, {threads} threads; {load()}")
        ratios = compare_watch(cfg, a.repeats, a.watch_every, a.watch_correction)
        for name, rs in ratios.items():
            print(f"{name}: with / without the watch, median {statistics.median(rs):.3f} (repeats {rs})")
        print(f"watch_slowdown: {statistics.median(ratios['partner']):.3f}")
        return
    print(f"world {world}; B=16 G=8, {a.steps} steps, {threads} threads, median of {a.repeats}; {load()}")
    loops = compare_loops(cfg, a.repeats)
    for name, label in LOOPS.items():
        s = loops[name]["split"]
        print(f"{label + ':':24s}{statistics.median(loops[name]['rates']):6.2f} steps/s  per step: "
              + ", ".join(f"{k} {s[k]:.1f}ms" for k in PHASES))
    print(f"after the loops: {load()}")
    others = other_steps(world)
    for k, v in others.items():
        print(f"{k}: {'not built yet' if v is None else f'{v:.2f}s'}")
    if a.world is None:
        secs = ensure_world("worlds", 0, None, "full")[1]["timings"]["total_s"]
        print(f"build_world (full): {secs:.1f}s, as recorded in its manifest when it was built")
    print("\n" + table(loops, a.steps, threads, others) + "\n")
    speedup = statistics.median(loops["ours"]["rates"]) / statistics.median(loops["seed"]["rates"])
    print(f"speedup: {speedup:.2f}")


if __name__ == "__main__":
    main()
