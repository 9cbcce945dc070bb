"""Recipe sweeps on Ray Tune: a grid of recipes, one Tune trial per pack of `batch` recipes (trained
together: training/batched.py), a table of results and the best trial by certified quality.

This module is orchestration only. It knows neither MLflow nor training: a trial is any picklable
`trial_fn(recipes: list[dict]) -> list[dict]` (one row per recipe, or {"error": message} for one that
failed; the tracking layer builds the real one: train, evaluate, certify, check the guardrails), and
ranking reads the columns that function returns. Locally Ray starts
itself with one CPU per trial, so single-thread trials run side by side; with `ray_address` (or
RAY_ADDRESS) the same sweep runs on an existing cluster.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from rlhf_mlflow.core.config import check_range, parse_override
from rlhf_mlflow.core.errors import InputError

log = logging.getLogger(__name__)
CERTIFIED = "certified/balanced"
"""Column of the certified balanced (deployment-mix) true-quality estimate that ranks trials."""
CERTIFIED_LO = "certified_lo/balanced"
"""Lower end of its interval (breaks ties)."""
GUARDRAIL_PREFIX = "guardrail/"
"""Columns `guardrail/<name>` hold True when that release guardrail passed."""


@dataclass(frozen=True)
class SweepConfig:
    ray_address: str | None = None
    """Ray cluster to run on (default: RAY_ADDRESS, else a local Ray started for this sweep)."""
    max_concurrent: int = 0
    """Trials running at once (0: as many as the CPUs allow, trial_threads CPUs each)."""
    trial_threads: int = 1
    """CPUs (and torch threads) per trial."""
    storage: str | None = None
    """Directory for Ray Tune's own trial records (default: a temporary directory)."""
    name: str = "sweep"
    """Name of the Tune experiment (and of the parent MLflow run)."""
    batch: int = 1
    """Recipes per Tune trial, trained together as one batch (RLHF_BATCH_RUNS)."""

    def __post_init__(self):
        check_range("max_concurrent", self.max_concurrent, 0, 1024, integer=True)
        check_range("trial_threads", self.trial_threads, 1, 256, integer=True)
        check_range("batch", self.batch, 1, None, integer=True)


def parse_grid(specs: list[str] | tuple[str, ...]) -> dict[str, list]:
    """['kl_coef=0.02,0.05', 'steps=800,1200'] -> {'kl_coef': [0.02, 0.05], 'steps': [800, 1200]}.
    One string may hold several, separated by ';'. Values are parsed as JSON when they are JSON; a
    JSON list gives the values ('family_weights=[{"dune": 0}, null]')."""
    grid: dict[str, list] = {}
    specs = [s for spec in specs for s in spec.split(";") if s.strip()]  # MLproject passes one string
    for spec in specs:
        key, raw = parse_override(spec)
        if not key:
            raise InputError(f"--grid {spec!r}: expected key=v1,v2,...")
        if isinstance(raw, (dict, list)):
            values = raw if isinstance(raw, list) else [raw]
        else:
            values = [parse_override(f"{key}={v}")[1] for v in str(raw).split(",")]
        if key in grid:
            raise InputError(f"--grid {key}: given twice; put all its values in one --grid {key}=v1,v2")
        grid[key] = values
    return grid


def expand_grid(grid: dict[str, list]) -> list[dict]:
    """The cartesian product of the grid, in order: one recipe (a dict of overrides) per trial."""
    if not grid:
        return [{}]
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def trial_name(recipe: dict) -> str:
    """A readable, stable name: 'kl_coef=0.05,steps=800' (the base recipe: 'base')."""
    return ",".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in recipe.items()) or "base"


def _ray_init(cfg: SweepConfig, env_vars: dict[str, str]) -> bool:
    """Connect to the cluster, or start a local Ray; returns whether we started it."""
    import ray
    address = cfg.ray_address or os.environ.get("RAY_ADDRESS")
    runtime_env = {"env_vars": env_vars}
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=False)
        return False
    ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, runtime_env=runtime_env,
             object_store_memory=200 * 1024 ** 2, log_to_driver=False, configure_logging=False)
    return True


def _trainable(config: dict, trial_fn: Callable[[list[dict]], list[dict]]) -> None:
    from ray import tune
    tune.report({"rows": json.dumps(trial_fn(config["pack"]), default=str)})


def run_sweep(trial_fn: Callable[[list[dict]], list[dict]], recipes: list[dict], cfg: SweepConfig) -> pd.DataFrame:
    """Run the recipes as Tune trials of cfg.batch recipes each and return one row per recipe: its keys,
    what trial_fn returned for it, and `trial`, `status` (FINISHED or ERROR) and `error`."""
    if not (cfg.ray_address or os.environ.get("RAY_ADDRESS")):
        # a private Ray for this sweep talks over loopback (by default Ray advertises the machine's
        # network address); read when ray is first imported
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from ray import tune
    env = {"RAY_CHDIR_TO_TRIAL_DIR": "0",
           "OMP_NUM_THREADS": str(cfg.trial_threads), "RLHF_THREADS": str(cfg.trial_threads)}
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    started = _ray_init(cfg, env)
    storage = cfg.storage or tempfile.mkdtemp(prefix="rlhf-sweep-")  # Tune's own records
    packs = [recipes[i:i + cfg.batch] for i in range(0, len(recipes), cfg.batch)]
    try:
        trainable = tune.with_resources(tune.with_parameters(_trainable, trial_fn=trial_fn),
                                        {"cpu": cfg.trial_threads})
        tuner = tune.Tuner(
            trainable, param_space={"pack": tune.grid_search(packs)},
            tune_config=tune.TuneConfig(max_concurrent_trials=cfg.max_concurrent or None, reuse_actors=True),
            run_config=tune.RunConfig(name=cfg.name, storage_path=os.path.abspath(storage), verbose=0,
                                      failure_config=tune.FailureConfig(max_failures=0, fail_fast=False)))
        rows = [row for result in tuner.fit() for row in _rows(result)]
    finally:
        if started:
            import ray
            ray.shutdown()
        if not cfg.storage:
            shutil.rmtree(storage, ignore_errors=True)
    order = {trial_name(r): i for i, r in enumerate(recipes)}
    frame = pd.DataFrame(rows)
    return frame.sort_values("trial", key=lambda s: s.map(order)).reset_index(drop=True)


def _rows(result) -> list[dict]:
    """A Tune trial's result as one row per recipe of its pack."""
    pack = (result.config or {}).get("pack", [])
    reported = json.loads((result.metrics or {}).get("rows", "[]")) if not result.error else []
    rows = []
    for k, recipe in enumerate(pack):
        got = reported[k] if k < len(reported) else {"error": _one_line(result.error) if result.error else "no result"}
        error = got.pop("error", "")
        row = {"trial": trial_name(recipe), **recipe, **got, "status": "ERROR" if error else "FINISHED", "error": error}
        rows.append({key: v for key, v in row.items() if not _tune_bookkeeping(key)})
    return rows


_TUNE_KEYS = {"timestamp", "checkpoint_dir_name", "done", "training_iteration", "trial_id", "date", "time_this_iter_s",
              "time_total_s", "pid", "hostname", "node_ip", "config", "time_since_restore", "iterations_since_restore",
              "experiment_tag", "should_checkpoint"}


def _tune_bookkeeping(key: str) -> bool:
    return key in _TUNE_KEYS or key.startswith("config/")


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return next((line for line in reversed(text) if line.strip()), type(error).__name__)[:300]


def guardrail_columns(frame: pd.DataFrame) -> list[str]:
    return [c for c in frame.columns if c.startswith(GUARDRAIL_PREFIX)]


def rank_trials(frame: pd.DataFrame) -> pd.DataFrame:
    """Add `eligible` (finished, certified, every guardrail passed) and `rank` (1 = best certified
    balanced quality among the eligible; ties go to the higher lower bound). Never ranks by proxy."""
    out = frame.copy()
    gates = guardrail_columns(out)
    eligible = out.get("status", pd.Series("FINISHED", index=out.index)).eq("FINISHED")
    eligible &= out[CERTIFIED].notna() if CERTIFIED in out else False
    for g in gates:
        eligible &= out[g].fillna(False).astype(bool)
    out["eligible"] = eligible & bool(gates)  # no guardrail evaluated: nothing is eligible
    out["rank"] = pd.NA
    if out["eligible"].any():
        lo = out.get(CERTIFIED_LO, pd.Series(0.0, index=out.index)).fillna(-1.0)
        ranked = out[out["eligible"]].assign(_lo=lo).sort_values([CERTIFIED, "_lo"], ascending=False)
        out.loc[ranked.index, "rank"] = range(1, len(ranked) + 1)
    return out


def best_trial(ranked: pd.DataFrame) -> pd.Series | None:
    """The rank-1 row of rank_trials' frame, or None when no trial is eligible."""
    top = ranked[ranked["rank"] == 1]
    return None if top.empty else top.iloc[0]
