"""train_rl speed: the seed-faithful loop vs ours, same config and seeds, in one process, paired per repeat.

    python benchmarks/train_rl_speed.py [--steps 200] [--repeats 3] [--world DIR] [--target 3.0] [--batch 8]
    python benchmarks/train_rl_speed.py --watch-every 50 [--steps 400] [--repeats 3] [--world DIR]

Runs the arms of ARMS (B=16 x G=8): the seed-faithful loop, train_rl as it runs by default, train_rl
held to one process on one thread, train_rl in one process at the run's threads (RLHF_PARTNER=off), and
--batch runs trained together in one process (training/batched.py; policy-steps/s against the seed loop's,
which is the seed loop running them one after another), --batch runs split between two one-thread worker
processes, batched in each (benchmarks/batched_workers.py: how `main` trains its candidates), and the same
runs unbatched in the same workers (what the batching itself adds).
Each repeat runs every arm once, in an order that rotates between repeats; ratios are taken within a
repeat. Prints per arm and repeat steps/s, the per-step split and the machine around it (1-min load
before->after, CPU steal, CPUs others used: benchmarks/machine_load.py); per arm the ratios to the
seed loop (median, range); the other steps' times; a markdown table; a WARNING naming the busy repeats;
`batched_verdict:` and `batched_speedup: X.XX (range A-B, ...)` (the batched workers' arm; target 5.0);
`verdict: met` / `not met` (median ours / seed against --target) / `none: machine busy (repeats ...)`; and last
`speedup: X.XX (range A-B, median of N paired repeats; load ...)`.
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
from dataclasses import dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import machine_load, paired, seed_loop  # noqa: E402
from benchmarks.batched_workers import Workers, seeded, train_share  # noqa: E402
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
TARGET = 3.0  # issue #32: ours / seed-faithful >= 3.0 on a quiet machine


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


@dataclass(frozen=True)
class Arm:
    """One way to train, timed against the others. `run(cfg, timings)` trains `cfg`, adds its seconds per
    phase (PHASES) to `timings` and returns the policy-steps it made: cfg.steps for one policy, N *
    cfg.steps for N policies trained together. An arm's figure is policy-steps per second, its ratio
    that over the seed loop's in the same repeat (the seed loop training N policies one after another
    makes policy-steps at its one-policy rate, so the same ratio compares a batched arm)."""
    name: str
    label: str
    run: Callable[[RLConfig, dict], int]


def _seed(cfg: RLConfig, t: dict) -> int:
    seed_loop.train(cfg, t)
    return cfg.steps


def _ours(cfg: RLConfig, t: dict) -> int:
    train_rl(cfg, timings=t)
    return cfg.steps


def _one_thread(cfg: RLConfig, t: dict) -> int:
    """Ours on one thread: no partner process (RLHF_THREADS=1; what main's and the sweep's side-by-side
    workers run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _ours(cfg, t)
    finally:
        torch.set_num_threads(threads)


def _no_partner(cfg: RLConfig, t: dict) -> int:
    """Ours in one process at the run's threads (RLHF_PARTNER=off)."""
    old = os.environ.get(partner.PARTNER_ENV)
    os.environ[partner.PARTNER_ENV] = "off"
    try:
        return _ours(cfg, t)
    finally:
        if old is None:
            del os.environ[partner.PARTNER_ENV]
        else:
            os.environ[partner.PARTNER_ENV] = old


BATCH = 8
"""Runs the batched arm trains together (--batch)."""
BATCHED_TARGET = 5.0  # issue #32: N batched runs' policy-steps/s >= 5.0 x the seed loop's


def _batched(cfg: RLConfig, t: dict) -> int:
    """BATCH runs (seeds cfg.seed, +1, ...) trained together in one process at the run's threads
    (training/batched.py); its phase split is the batch's (each member's step is the batch's step)."""
    steps, phases = train_share(seeded(cfg, BATCH))
    for k, secs in phases.items():
        t[k] = t.get(k, 0.0) + secs
    return steps


_WORKERS: Workers | None = None
"""The batched_2w and runs_2w arms' worker processes: started at their first (warm-up) run, kept to the end."""


def _workers() -> Workers:
    global _WORKERS
    if _WORKERS is None:
        _WORKERS = Workers()
    return _WORKERS


def _batched_workers(cfg: RLConfig, t: dict) -> int:
    """BATCH runs split between two one-thread worker processes, each share batched in its worker."""
    return _workers().train(cfg, BATCH, t)


def _runs_workers(cfg: RLConfig, t: dict) -> int:
    """The same BATCH runs in the same workers, unbatched: one after another in each."""
    return _workers().train(cfg, BATCH, t, batched=False)


def own_cpu_seconds() -> float:
    """This process's CPU seconds, its reaped children's and the batched_2w workers'."""
    return machine_load.own_cpu_seconds() + (_WORKERS.cpu_seconds() if _WORKERS is not None else 0.0)


BASE = "seed"
BATCHED = "batched_2w"
"""The arm batched_speedup is read from: the runs batched as main trains them."""
ARMS = (Arm(BASE, "seed-faithful loop", _seed), Arm("ours", "train_rl", _ours),
        Arm("ours_1p", "train_rl, one process, one thread", _one_thread),
        Arm("ours_off", "train_rl, one process, run's threads", _no_partner),
        Arm("batched", "train_rl, BATCH runs batched in one process", _batched),
        Arm(BATCHED, "train_rl, BATCH runs batched in two one-thread workers", _batched_workers),
        Arm("runs_2w", "train_rl, BATCH runs unbatched in two one-thread workers", _runs_workers))
"""The arms every repeat runs; a new one is one more entry."""
MODES = (("ours", "ours_1p"), ("ours_off", "ours_1p"), (BATCHED, "runs_2w"))
"""The process modes against each other, paired too (docs/PERFORMANCE.md: the default per machine class),
and what batching adds to the same runs in the same workers."""


@dataclass
class Results:
    """Per arm: policy-steps/s per repeat and the mean per-step split (ms); per repeat the busy reasons."""
    rates: dict[str, list[float]]
    split: dict[str, dict[str, float]]
    loads: list[machine_load.Load]
    busy: list[list[str]]


def run_arm(arm: Arm, cfg: RLConfig, threads: int) -> tuple[float, dict, machine_load.Load, list[str]]:
    """One timed run of `arm`: policy-steps/s, the per-phase seconds, the machine around it and why busy."""
    t: dict[str, float] = {}
    own, before = own_cpu_seconds(), machine_load.mark()
    steps = arm.run(cfg, t)
    after = machine_load.mark()
    g = machine_load.between(before, after, own_cpu_seconds() - own)
    return steps / (after.wall - before.wall), t, g, machine_load.busy_reasons(g, threads)


def compare_arms(cfg: RLConfig, arms: tuple[Arm, ...], repeats: int, threads: int) -> Results:
    """Every repeat runs every arm once, in a rotating order; prints a line per arm and per repeat."""
    out = Results({a.name: [] for a in arms}, {a.name: dict.fromkeys(PHASES, 0.0) for a in arms}, [], [])
    warm = replace(cfg, steps=3, log_every=3)  # one-time costs (lazy library init, first allocations) off the clock
    for arm in arms:
        arm.run(warm, {})
    for r in range(repeats):
        reasons: list[str] = []
        for arm in paired.order(arms, r):
            rate, t, g, why = run_arm(arm, cfg, threads)
            out.rates[arm.name].append(rate)
            out.loads.append(g)
            reasons += [f"{arm.name}: {w}" for w in why]
            for k in PHASES:
                out.split[arm.name][k] += 1000 * t.get(k, 0.0) / cfg.steps / repeats
            print(f"  repeat {r + 1} {arm.name:8s}{rate:7.2f} steps/s  "
                  + " ".join(f"{k} {1000 * t.get(k, 0.0) / cfg.steps:.1f}ms" for k in PHASES)
                  + f"  | {machine_load.describe(g)}{'  BUSY: ' + ', '.join(why) if why else ''}", flush=True)
        out.busy.append(reasons)
        print(f"  repeat {r + 1} vs {BASE}: " + ", ".join(
            f"{a.name} {out.rates[a.name][r] / out.rates[BASE][r]:.2f}" for a in arms if a.name != BASE)
            + ("  (busy)" if reasons else ""), flush=True)
    return out


def report(res: Results, arms: tuple[Arm, ...], target: float) -> None:
    """Ratios per arm (median, range), the busy warning, the verdict, and last the `speedup:` line."""
    for arm in arms:
        if arm.name != BASE:
            print(f"{arm.name} / {BASE}: {paired.summarise(paired.ratios(res.rates, arm.name, BASE))}")
    for a, b in MODES:
        if {a, b} <= res.rates.keys():
            print(f"{a} / {b}: {paired.summarise(paired.ratios(res.rates, a, b))}")
    busy = paired.busy_repeats(res.busy)
    if busy:
        print(f"WARNING: machine busy in repeats {', '.join(map(str, busy))} (BUSY on their lines; the rule: "
              f"benchmarks/machine_load.py); their ratios measure the load as much as the code")
    if BATCHED in res.rates:
        b = paired.summarise(paired.ratios(res.rates, BATCHED, BASE))
        print(f"batched_verdict: {paired.verdict(b, busy, BATCHED_TARGET)}")
        print(f"batched_speedup: {b.median:.2f} (range {b.lo:.2f}-{b.hi:.2f}, {BATCH} runs batched in two one-thread "
              f"workers against the seed loop running them one after another)")
    s = paired.summarise(paired.ratios(res.rates, "ours", BASE))
    print(f"verdict: {paired.verdict(s, busy, target)}")
    print(f"speedup: {s.median:.2f} (range {s.lo:.2f}-{s.hi:.2f}, median of {len(s.ratios)} paired repeats; "
          f"{machine_load.span(res.loads)})")


def compare_watch(cfg: RLConfig, repeats: int, every: int, correction: str | None = None) -> dict[str, list[float]]:
    """Per setting (with the partner, one process): the ratio of train_rl's seconds with the watch on
    (every `every` steps, from step 0) to without, per repeat, each pair run back to back; and
    (", inside") the watched run's seconds over the same run's seconds outside the watch, which a
    drifting machine moves less. `correction` (a correction file): the watch's predictor and the
    shortcuts it counts, as in `main`; the watch's dense start is RLConfig's default."""
    from rlhf_mlflow.core.reward_wrapper import load_wrapper
    from rlhf_mlflow.evidence.watch import PolicyWatch as Watch
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
        from rlhf_mlflow.evidence.diagnostic import run_diagnostic
        out["diagnostic"] = timed(lambda: run_diagnostic(j("reward_model"), j("policy"),
                                                         j("data", "prompts_train.jsonl")))
    except ImportError:
        out["diagnostic"] = None
    try:
        from rlhf_mlflow.evidence.certify import certify
        out["certify"] = timed(lambda: certify(j("policy"), j("policy"), j("data", "gold_calib.jsonl"),
                                               rm_dir=j("reward_model")))
    except ImportError:
        out["certify"] = None
    with tempfile.TemporaryDirectory() as tmp:
        out["build_world (test scale)"] = timed(lambda: build_world(os.path.join(tmp, "w"), 0, None, "test"))
    return out


def table(res: Results, arms: tuple[Arm, ...], steps: int, threads: int, others: dict[str, float | None]) -> str:
    """The README's performance table (markdown)."""
    rows = ["| | steps/s | ms/step | sample | score | backward |", "|---|---:|---:|---:|---:|---:|"]
    for arm in arms:
        rate, s = statistics.median(res.rates[arm.name]), res.split[arm.name]
        rows.append(f"| {arm.label} | {rate:.1f} | {1000 / rate:.1f} | " + " | ".join(f"{s[k]:.1f}" for k in PHASES)
                    + " |")
    sp = paired.summarise(paired.ratios(res.rates, "ours", BASE))
    rows.append(f"\nB=16 x G=8, {steps} steps, median of {len(sp.ratios)}, {threads} threads (train_rl: "
                f"{'with' if partner.available(threads, 16) else 'without'} its partner process); times in ms per "
                f"step; speedup {sp.median:.2f}x (paired repeats {sp.lo:.2f}-{sp.hi:.2f}; "
                f"{machine_load.span(res.loads)}).\n")
    rows += ["| step | seconds |", "|---|---:|"]
    rows += [f"| {k} | {'n/a' if v is None else f'{v:.2f}'} |" for k, v in others.items()]
    return "\n".join(rows)


def main() -> None:
    global BATCH
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--world", default=None, help="world directory (default: the default world, built once)")
    ap.add_argument("--target", type=float, default=TARGET, help="the verdict's bar for the median ours / seed")
    ap.add_argument("--no-other-steps", action="store_true", help="skip timing dev_eval, diagnostic, certify, a world")
    ap.add_argument("--batch", type=int, default=8, help="runs the batched arm trains together")
    ap.add_argument("--watch-every", type=int, default=0, help="compare train_rl with and without the watch")
    ap.add_argument("--watch-correction", help="with --watch-every: a correction file (the diagnostic's, as main "
                                               "passes it): the watch's predictor and the shortcuts it counts")
    a = ap.parse_args()
    if a.repeats < 1 or a.steps < 1 or a.batch < 1:
        ap.error("--steps, --repeats and --batch must be at least 1")
    BATCH = a.batch
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
    print(f"world {world}; B=16 G=8, {a.steps} steps, {threads} threads, {os.cpu_count()} CPUs, {a.repeats} paired "
          f"repeats; {load()}")
    try:
        res = compare_arms(cfg, ARMS, a.repeats, threads)
    finally:
        if _WORKERS is not None:
            _WORKERS.close()
    for arm in ARMS:
        s = res.split[arm.name]
        print(f"{arm.label + ':':38s}{statistics.median(res.rates[arm.name]):6.2f} steps/s  per step: "
              + ", ".join(f"{k} {s[k]:.1f}ms" for k in PHASES))
    others = {} if a.no_other_steps else other_steps(world)
    for k, v in others.items():
        print(f"{k}: {'not built yet' if v is None else f'{v:.2f}s'}")
    if a.world is None and not a.no_other_steps:
        secs = ensure_world("worlds", 0, None, "full")[1]["timings"]["total_s"]
        print(f"build_world (full): {secs:.1f}s, as recorded in its manifest when it was built")
    print("\n" + table(res, ARMS, a.steps, threads, others) + "\n")
    report(res, ARMS, a.target)


if __name__ == "__main__":
    main()
