"""Batched runs as `main` trains its candidates: the runs split between worker processes of one torch thread
each, every worker training its share batched in one process (training/batched.py), for
benchmarks/train_rl_speed.py's `batched_2w` arm; and the same runs unbatched (`runs_2w`: one after another
in each worker), which says what the batching itself adds.

The workers start once (spawned, one thread each) and stay for the whole benchmark, so an arm's time is the
training's, not Python's and torch's start-up. They are not children the benchmark reaps until it ends, so
their CPU seconds are read from /proc (`cpu_seconds`) and counted as the benchmark's own, not as other load.
"""
from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import torch

from benchmarks.machine_load import process_cpu_seconds
from rlhf_mlflow.training.batch_run import run_all
from rlhf_mlflow.training.rl_config import RLConfig
from rlhf_mlflow.training.train_rl import train_rl

WORKERS = 2
"""Worker processes (main's: one per CPU on this two-CPU class)."""


def _one_thread() -> None:
    torch.set_num_threads(1)


def seeded(cfg: RLConfig, n: int) -> list[RLConfig]:
    """n runs of cfg, seeds cfg.seed, +1, ..."""
    return [replace(cfg, seed=cfg.seed + k) for k in range(n)]


def train_share(cfgs: list[RLConfig], batched: bool = True) -> tuple[int, dict]:
    """Train `cfgs` batched together in this process (or one after another); returns the policy-steps made
    and the first run's seconds per phase (a batch member's step is the batch's step)."""
    timings: dict[str, float] = {}
    if batched:
        run_all([lambda seat, c=c, k=k: train_rl(c, seat=seat, timings=timings if k == 0 else None)
                 for k, c in enumerate(cfgs)])
    else:
        for k, c in enumerate(cfgs):
            train_rl(c, timings=timings if k == 0 else None)
    return sum(c.steps for c in cfgs), timings


class Workers:
    """The pool; `train(cfg, n, timings)` trains n runs (seeds cfg.seed, +1, ...) across it, each worker's
    share batched (or, batched=False, one run after another)."""

    def __init__(self, workers: int = WORKERS):
        self.workers = workers
        self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=_one_thread)

    def train(self, cfg: RLConfig, n: int, timings: dict, batched: bool = True) -> int:
        cfgs = seeded(cfg, n)
        shares = [cfgs[w::self.workers] for w in range(self.workers) if cfgs[w::self.workers]]
        futures = [self.pool.submit(train_share, share, batched) for share in shares]
        steps = 0
        for k, fut in enumerate(futures):
            made, t = fut.result()
            steps += made
            if k == 0:
                for name, secs in t.items():
                    timings[name] = timings.get(name, 0.0) + secs
        return steps

    def pids(self) -> list[int]:
        return list((getattr(self.pool, "_processes", None) or {}).keys())

    def cpu_seconds(self) -> float:
        """User + system seconds the live workers have used so far (0 where /proc cannot tell)."""
        return sum(process_cpu_seconds(pid) for pid in self.pids())

    def close(self) -> None:
        self.pool.shutdown()

