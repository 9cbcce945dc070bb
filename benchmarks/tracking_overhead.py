"""MLflow logging cost: train_rl with tracking (real sqlite store in a temp dir) vs without.

    python benchmarks/tracking_overhead.py [--steps 800] [--repeats 3] [--world DIR]

Prints the loop time of each (median of --repeats, interleaved), the end-to-end time of the tracked
run (params, datasets, figures, model logging and registration included) and the loop overhead in %.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhf_mlflow.core.process import configure_threads  # noqa: E402
from rlhf_mlflow.core.world_paths import WorldPaths  # noqa: E402
from rlhf_mlflow.training.rl_config import RLConfig  # noqa: E402
from rlhf_mlflow.training.train_rl import train_rl  # noqa: E402
from rlhf_mlflow.world.build import ensure_world  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--world", default=None)
    a = ap.parse_args()
    configure_threads()
    world = a.world or ensure_world("worlds", 0, None, "full", progress=print)[0]
    cfg = RLConfig(steps=a.steps).resolved(world)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp}/mlflow.db"
        os.chdir(tmp)
        from rlhf_mlflow.steps.train_rl import run_train_rl
        plain, tracked_loop, tracked_total = [], [], []
        for r in range(a.repeats):
            plain.append(train_rl(cfg).seconds)
            t = time.perf_counter()
            summary = run_train_rl(cfg, world=WorldPaths.at(world), run_name=f"overhead-{r}", progress=False,
                                   echo=lambda m: None)
            tracked_total.append(time.perf_counter() - t)
            tracked_loop.append(summary["seconds"])
            print(f"  repeat {r + 1}: plain {plain[-1]:.1f}s, tracked loop {tracked_loop[-1]:.1f}s, "
                  f"tracked run end to end {tracked_total[-1]:.1f}s", flush=True)
    p, tl, tt = statistics.median(plain), statistics.median(tracked_loop), statistics.median(tracked_total)
    print(f"train_rl {a.steps} steps: plain {p:.1f}s, tracked loop {tl:.1f}s, tracked end to end {tt:.1f}s")
    print(f"fixed cost of the run (params, datasets, figure, model logging + registration): {tt - tl:.1f}s")
    print(f"loop_overhead: {100 * (tl - p) / p:.1f}%")


if __name__ == "__main__":
    main()
