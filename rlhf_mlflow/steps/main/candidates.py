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
from rlhf_mlflow.training.batch_run import batch_runs, run_all
from rlhf_mlflow.training.batched import Seat
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
    `on_done(name, summary)` runs here as each group of jobs finishes (in the parallel case while others
    train, on one thread so that it takes a core only when a worker has left one idle).

    Jobs train in groups of up to RLHF_BATCH_RUNS (training/batched.py: one batched step for all of a
    group's runs). With >= 2 torch threads the groups run in that many worker processes of one thread
    each, longest first: two one-thread processes side by side get more done than one process with two
    threads at these sizes (docs/PERFORMANCE.md). With one thread they run here, one after another.
    """
    workers = min(configure_threads(), len(jobs))
    groups = job_groups(jobs, workers, batch_runs())
    T.log_prompt_files({world.prompts_train})  # before any worker logs it (see log_prompt_files)
    env = WorkerEnv(absolute_tracking_uri(), experiment_of(parent_run_id), parent_run_id, world.root)
    done: dict[str, dict] = {}
    if workers < 2:
        for group in groups:  # nested under main's active run
            for name, summary, _ in _train_group(env, group, echo):
                done[name] = summary
                if on_done is not None:
                    on_done(name, summary)
    else:
        done = _in_workers(groups, env, workers, echo, on_done)
    return {job.name: done[job.name] for job in jobs}


def job_groups(jobs: list[TrainJob], workers: int, size: int) -> list[list[TrainJob]]:
    """Jobs in groups of at most `size`, at least `workers` groups where there are jobs enough, each
    job (longest first) in the group with the fewest steps so far that has room: groups finish together."""
    count = max(min(workers, len(jobs)), -(-len(jobs) // max(1, size)))
    groups: list[list[TrainJob]] = [[] for _ in range(count)]
    for job in sorted(jobs, key=lambda j: -j.overrides["steps"]):
        open_ = [g for g in groups if len(g) < size] or groups
        min(open_, key=lambda g: sum(j.overrides["steps"] for j in g)).append(job)
    return [g for g in groups if g]


def _in_workers(groups: list[list[TrainJob]], env: WorkerEnv, workers: int, echo: Callable[[str], None],
                on_done: Callable[[str, dict], None] | None) -> dict[str, dict]:
    done: dict[str, dict] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_enter_worker, initargs=(env,)) as pool:
        futures = [pool.submit(_train_group, env, group) for group in groups]
        echo(f"training {sum(map(len, groups))} candidates, {workers} side by side (one thread each)"
             + (f", in {len(groups)} batched groups" if len(groups) < sum(map(len, groups)) else ""))
        try:
            for fut in as_completed(futures):
                for name, summary, lines in fut.result():
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


def _train_group(env: WorkerEnv, group: list[TrainJob], echo: Callable[[str], None] | None = None
                 ) -> list[tuple[str, dict, list[str]]]:
    """Train a group's jobs, batched together when there are several (their runs are members of one
    batch, each in its own thread); returns each job's (name, summary, lines). A job that failed fails
    the group, once the others have finished."""
    if len(group) == 1:
        return [_train_job(env, group[0], echo)]
    return run_all([lambda seat, job=job: _train_job(env, job, echo, seat) for job in group])


PROGRESS_EVERY = 30.0
"""Seconds between a training candidate's progress lines (workers print them as they go)."""


def _enter_worker(env: WorkerEnv) -> None:
    """A worker process: one torch thread, main's store and experiment, never the launcher's run."""
    enter_worker(env.tracking_uri, env.experiment_name, 1)


def _train_job(env: WorkerEnv, job: TrainJob, echo: Callable[[str], None] | None = None, seat: Seat | None = None
               ) -> tuple[str, dict, list[str]]:
    """Train one job as a child of main's run (a member of a batch, with `seat`); returns (name, summary,
    the lines it would print)."""
    lines: list[str] = []
    say = echo or lines.append
    world = WorldPaths(env.world_root)
    if job.resume_run_id:
        summary = resume_train_rl(job.resume_run_id, echo=say, progress=PROGRESS_EVERY, seat=seat)
        say(f"  {job.name}: resumed run {job.resume_run_id}, {summary['seconds']:.0f} s")
        return job.name, summary, lines
    say(f"train_rl {job.name} (kl {job.overrides['kl_coef']:g}, {job.overrides['steps']} steps)")
    cfg = load_rl_config(world.config, job.overrides)
    select = "watch_proposal" if job.select_watch_best else None  # certify buys the labels that vouch for it
    summary = run_train_rl(cfg, world=world, run_name=job.name, description=job.description,
                           tags={**job.tags, "mlflow.parentRunId": env.parent_run_id},
                           echo=lambda m: None, progress=PROGRESS_EVERY, select=select, seat=seat)
    say(f"  {job.name}: {cfg.steps} steps in {summary['seconds']:.0f} s")
    return job.name, summary, lines
