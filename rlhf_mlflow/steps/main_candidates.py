"""`main`'s candidates: each recipe a train_rl run, child of main's run, trained in worker processes
side by side, each with the over-optimisation watch on (every WATCH_EVERY steps); corrected candidates
are registered at the watch's proposal (its best estimated balanced truth, whether or not the expert
set could vouch for every family there: certify then buys the expert labels that vouch for it, or it is
refused)."""
from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

import torch

from rlhf_mlflow.core.process import configure_threads
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.steps.train_rl import resume_train_rl, run_train_rl
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking.workers import (
    absolute_tracking_uri,
    enter_worker,
    experiment_of,
)
from rlhf_mlflow.training.rl_config import load_rl_config

CHECKPOINTS = 4  # a corrected candidate is saved at each quarter of its steps
WATCH_EVERY = 50
"""main's candidates estimate their true quality per family every this many steps (train_rl's watch)."""


@dataclass(frozen=True)
class TrainJob:
    """One candidate's train_rl run, as main hands it to a worker."""
    name: str
    overrides: dict
    description: str
    tags: dict
    select_watch_best: bool = False
    resume_run_id: str | None = None
    """A run of this job that stopped before registering (a resumed `main`): continued from its newest
    complete checkpoint, in that run (`resume_train_rl`)."""


@dataclass(frozen=True)
class WorkerEnv:
    """What a worker needs (picklable): main's store, experiment, run and world."""
    tracking_uri: str
    experiment_name: str
    parent_run_id: str
    world_root: str


def train_all(jobs: list[TrainJob], world: WorldPaths, parent_run_id: str, echo: Callable[[str], None],
              on_done: Callable[[str, dict], None] | None = None) -> dict[str, dict]:
    """Run every job as a child train_rl run of `parent_run_id`; returns {name: run summary} in job order.
    `on_done(name, summary)` runs here as each job finishes (in the parallel case while others train,
    on one thread so that it takes a core only when a worker has left one idle).

    With >= 2 torch threads the jobs run in that many worker processes of one thread each, longest
    first: two one-thread runs side by side get more done (~21 steps/s together on 2 cores) than one
    run with its partner process (~18; see training/two_process_step.py).
    With one thread they run here, one after another.
    """
    workers = min(configure_threads(), len(jobs))
    T.log_prompt_files({world.prompts_train})  # before any worker logs it (see log_prompt_files)
    env = WorkerEnv(absolute_tracking_uri(), experiment_of(parent_run_id), parent_run_id, world.root)
    if workers < 2:
        out = {}
        for job in jobs:  # nested under main's active run
            out[job.name] = _train_job(env, job, echo)[1]
            if on_done is not None:
                on_done(job.name, out[job.name])
        return out
    done = _in_workers(jobs, env, workers, echo, on_done)
    return {job.name: done[job.name] for job in jobs}


def _in_workers(jobs: list[TrainJob], env: WorkerEnv, workers: int, echo: Callable[[str], None],
                on_done: Callable[[str, dict], None] | None) -> dict[str, dict]:
    done: dict[str, dict] = {}
    order = sorted(jobs, key=lambda job: -job.overrides["steps"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_enter_worker, initargs=(env,)) as pool:
        futures = [pool.submit(_train_job, env, job) for job in order]
        echo(f"training {len(jobs)} candidates, {workers} side by side (one thread each)")
        try:
            for fut in as_completed(futures):
                name, summary, lines = fut.result()
                for line in lines:
                    echo(line)
                done[name] = summary
                if on_done is not None:
                    on_done(name, summary)
        except BaseException:
            for fut in futures:
                fut.cancel()
            # the running ones get SIGTERM: each worker's run ends KILLED (see core/process.handle_signals)
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                proc.terminate()
            raise
        finally:
            torch.set_num_threads(threads)
    return done


PROGRESS_EVERY = 30.0
"""Seconds between a training candidate's progress lines (workers print them as they go)."""


def _enter_worker(env: WorkerEnv) -> None:
    """A worker process: one torch thread, main's store and experiment, never the launcher's run."""
    enter_worker(env.tracking_uri, env.experiment_name, 1)


def _train_job(env: WorkerEnv, job: TrainJob, echo: Callable[[str], None] | None = None
               ) -> tuple[str, dict, list[str]]:
    """Train one job as a child of main's run; returns (name, summary, the lines it would print)."""
    lines: list[str] = []
    say = echo or lines.append
    world = WorldPaths(env.world_root)
    if job.resume_run_id:
        summary = resume_train_rl(job.resume_run_id, echo=say, progress=PROGRESS_EVERY)
        say(f"  {job.name}: resumed run {job.resume_run_id}, {summary['seconds']:.0f} s")
        return job.name, summary, lines
    say(f"train_rl {job.name} (kl {job.overrides['kl_coef']:g}, {job.overrides['steps']} steps)")
    cfg = load_rl_config(world.config, job.overrides)
    select = "watch_proposal" if job.select_watch_best else None  # certify buys the labels that vouch for it
    summary = run_train_rl(cfg, world=world, run_name=job.name, description=job.description,
                           tags={**job.tags, "mlflow.parentRunId": env.parent_run_id},
                           echo=lambda m: None, progress=PROGRESS_EVERY, select=select)
    say(f"  {job.name}: {cfg.steps} steps in {summary['seconds']:.0f} s")
    return job.name, summary, lines
