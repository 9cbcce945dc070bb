"""The `sweep` step: a grid of RL recipes as Ray Tune trials under one parent MLflow run.

Each trial (sweep_trial.py) trains, evaluates, certifies and checks every release guardrail; the
trial table goes on the parent run (CSV and an MLflow table), and the best trial (highest certified
balanced quality among those whose every guardrail passed; never by proxy) is tagged there and can
be handed to release.
"""
from __future__ import annotations

import functools
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass

import pandas as pd

from rlhf_mlflow.core.config import from_dict
from rlhf_mlflow.core.errors import InputError, read_json
from rlhf_mlflow.core.world_paths import WorldPaths
from rlhf_mlflow.decisions.guardrails import GuardrailConfig
from rlhf_mlflow.steps.diagnostic import run_diagnostic_step
from rlhf_mlflow.steps.ray_tune import (
    SweepConfig,
    best_trial,
    expand_grid,
    rank_trials,
    run_sweep,
)
from rlhf_mlflow.steps.release import run_release
from rlhf_mlflow.steps.sweep_trial import TrialContext, run_trials
from rlhf_mlflow.tracking import metric_names as MN
from rlhf_mlflow.tracking import registry as REG
from rlhf_mlflow.tracking import runs as T
from rlhf_mlflow.tracking.workers import (
    absolute_tracking_uri,
    experiment_of,
    is_local_store,
)
from rlhf_mlflow.training.rl_config import PATH_KEYS, RLConfig, check_fields

MAX_TRIALS = 1000
"""The most trials a grid may hold (the product of its keys' value counts)."""


@dataclass(frozen=True)
class SweepResult:
    table: pd.DataFrame
    """One row per trial, ranked (rank_trials)."""
    best: pd.Series | None
    """The best trial's row, or None when no trial passed every guardrail."""
    run_id: str
    """The sweep's parent run."""


def check_grid(grid: dict[str, list]) -> None:
    """InputError unless the grid holds at most MAX_TRIALS trials and every numeric value is finite and
    in its field's range (what RLConfig checks): before a world is resolved or a run starts."""
    trials = math.prod(len(v) for v in grid.values())
    if trials > MAX_TRIALS:
        raise InputError(f"--grid: {trials:,} trials (the product of each key's number of values); at most "
                         f"{MAX_TRIALS}")
    for key, values in grid.items():
        for value in values:
            try:
                check_fields({key: value})
            except InputError as e:
                raise InputError(f"--grid {key}: {e}") from None


def checked_recipes(base: RLConfig, grid: dict[str, list]) -> list[dict]:
    """The grid's recipes with paths made absolute; every trial's config validated before anything runs."""
    check_grid(grid)
    out = []
    for recipe in expand_grid(grid):
        r = {k: os.path.abspath(v) if k in PATH_KEYS and isinstance(v, str) else v for k, v in recipe.items()}
        from_dict(RLConfig, {**asdict(base), **r}, f"--grid {r}")
        out.append(r)
    return out


def run_sweep_step(world: WorldPaths, base: RLConfig, grid: dict[str, list], guardrails: dict, scfg: SweepConfig,
                   diagnostic_path: str | None = None, echo: Callable[[str], None] = print) -> SweepResult:
    """Run every recipe of the grid as a trial; returns the ranked table and the best trial."""
    recipes = checked_recipes(base, grid)
    GuardrailConfig.from_dict(guardrails, "--guardrail")  # bad thresholds fail before any trial runs
    uri = absolute_tracking_uri()
    if (scfg.ray_address or os.environ.get("RAY_ADDRESS")) and is_local_store(uri):
        raise InputError(f"trials on a Ray cluster cannot write to the local store {uri}: start a shared "
                         "server (`rlhf-mlflow server`) and set MLFLOW_TRACKING_URI to it")
    params = {"grid": grid, "trials": len(recipes), "world": world.root,
              "ray_address": scfg.ray_address or os.environ.get("RAY_ADDRESS", "local"),
              "trial_threads": scfg.trial_threads, "batch_runs": scfg.batch, **{f"base.{k}": v for k, v in asdict(base).items()},
              **{f"guardrail.{k}": v for k, v in guardrails.items()}}
    with T.tracked_run("sweep", params, run_name=scfg.name) as run:
        T.log_prompt_files({base.prompt_file} | {r["prompt_file"] for r in recipes if "prompt_file" in r})
        champion = REG.champion_version()
        ctx = TrialContext(tracking_uri=uri, experiment_name=experiment_of(run.info.run_id),
                           parent_run_id=run.info.run_id, world_root=world.root, base=asdict(base),
                           threads=scfg.trial_threads, diagnostic=_diagnostic(world, diagnostic_path),
                           champion=champion and REG.champion_certification(champion), guardrails=guardrails)
        echo(f"sweep {run.info.run_id}: {len(recipes)} trials on Ray")
        ranked = rank_trials(run_sweep(functools.partial(run_trials, ctx), recipes, scfg))
        best = best_trial(ranked)
        _log_results(ranked, best)
    return SweepResult(ranked, best, run.info.run_id)


def release_best(result: SweepResult, guardrails: dict, echo: Callable[[str], None] = print) -> dict | None:
    """Hand the best trial's version to release with the sweep's thresholds: promoted to champion only
    if every guardrail passes against the champion at release time."""
    if result.best is None:
        return None
    return run_release(str(result.best["model_version"]), guardrails=guardrails, echo=echo)


def _diagnostic(world: WorldPaths, path: str | None) -> dict:
    """The given evidence JSON, else the gold-free diagnostic run once on the world (a child run)."""
    if path:
        return read_json(path)
    return run_diagnostic_step(world.reward_model, world.policy, world.prompts_train)


def _log_results(table: pd.DataFrame, best: pd.Series | None) -> None:
    """The trial table (CSV and an MLflow table) on the parent run; the best trial in its tags."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trials.csv")
        table.to_csv(path, index=False)
        T.log_artifact(path, "sweep")
    T.log_table(table, "sweep/trials.json")
    if best is None:
        T.set_tags({"rlhf.best_trial": "none: no trial passed every guardrail"})
        return
    T.set_tags({"rlhf.best_trial": best["trial"], "rlhf.best_run_id": best["run_id"],
                     "rlhf.best_model_version": str(best.get("model_version"))})
    T.log_metrics({MN.SWEEP + "best_certified/balanced": float(best["certified/balanced"])})
