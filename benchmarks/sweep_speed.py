"""Sweep speed: 4 recipes as a Ray Tune sweep (single-thread trials side by side) vs the same 4 trials
one after another in one process (torch's default threads, as `rlhf-mlflow train-rl` runs them).

    python benchmarks/sweep_speed.py [--steps 400] [--world DIR] [--sequential-threads N]

A trial is exactly what `rlhf-mlflow sweep` runs: a tracked train_rl run that registers a version,
dev_eval and certification with the guardrails, logged to a temporary sqlite store. Both sides use
the same trial function, recipes and seeds. The sweep's wall time includes starting and stopping the
local Ray. Prints each side's wall time and trial times, the load average, and last
`sweep_speedup: X.XX` (sequential wall time / sweep wall time).
"""
from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhf_mlflow.core.process import configure_threads  # noqa: E402
from rlhf_mlflow.steps.ray_tune import SweepConfig, run_sweep  # noqa: E402
from rlhf_mlflow.training.rl_config import RLConfig  # noqa: E402
from rlhf_mlflow.world.build import ensure_world  # noqa: E402

RECIPES = [{"kl_coef": k} for k in (0.02, 0.05, 0.1, 0.2)]


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400, help="RL steps per trial")
    ap.add_argument("--world", default=None, help="world directory (default: the default world, built once)")
    ap.add_argument("--sequential-threads", type=int, default=0,
                    help="torch threads of the sequential runs (0: the default, RLHF_THREADS or min(2, cores))")
    a = ap.parse_args()
    import mlflow

    from rlhf_mlflow.steps import sweep_trial as S
    from rlhf_mlflow.tracking import runs as T
    world = os.path.abspath(a.world or ensure_world("worlds", 0, None, "full", progress=print)[0])
    base = asdict(RLConfig(steps=a.steps, log_every=20).resolved(world))
    store = tempfile.mkdtemp(prefix="sweep-speed-")
    os.chdir(store)  # the store's default artifact root ./mlruns lands there too
    mlflow.set_tracking_uri(f"sqlite:///{store}/mlflow.db")
    if a.sequential_threads:
        os.environ["RLHF_THREADS"] = str(a.sequential_threads)
    seq_threads = configure_threads()
    print(f"world {world}; 4 recipes x {a.steps} steps (B=16, G=8); {os.cpu_count()} cores; load {load()}")

    def context(name: str, threads: int) -> S.TrialContext:
        mlflow.set_experiment(name)
        with T.tracked_run("sweep", {"benchmark": name}, run_name=name) as run:
            pass
        return S.TrialContext(tracking_uri=mlflow.get_tracking_uri(), experiment_name=name,
                              parent_run_id=run.info.run_id, world_root=world, base=base, threads=threads)

    ctx = context("sequential", seq_threads)
    t0 = time.perf_counter()
    seq_rows = [S.run_trial(ctx, r) for r in RECIPES]
    sequential = time.perf_counter() - t0
    print(f"sequential ({seq_threads} threads): {sequential:.1f}s; trial train_rl seconds "
          f"{[r['seconds'] for r in seq_rows]}; load {load()}", flush=True)

    ctx = context("sweep", 1)
    t0 = time.perf_counter()
    table = run_sweep(functools.partial(S.run_trial, ctx), RECIPES, SweepConfig(trial_threads=1, name="speed"))
    swept = time.perf_counter() - t0
    if (table["status"] != "FINISHED").any():
        raise SystemExit(f"sweep trials failed:\n{table[['trial', 'status', 'error']]}")
    print(f"sweep (Ray Tune, {os.cpu_count()} x 1-thread trials side by side): {swept:.1f}s; trial train_rl "
          f"seconds {list(table['seconds'])}; load {load()}")
    shutil.rmtree(store, ignore_errors=True)
    print(f"sweep_speedup: {sequential / swept:.2f}")


if __name__ == "__main__":
    main()
