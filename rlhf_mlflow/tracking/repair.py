"""`rlhf-mlflow runs --repair`: put the tracking store back in order after processes died.

- A RUNNING run whose process is gone (same host; pid and start time from its `rlhf.pid` tags) is
  marked FAILED (a train_rl run can still continue with `train-rl --resume RUN_ID`).
- A release lock whose holder is gone or whose lease ran out is removed.
- A version left `release.decision=promoting` (its release died between its tags and the alias move)
  is settled: `promoted` if the champion alias points at it, else `interrupted`.
Runs on other hosts, or without process tags, are listed and left alone: nothing here can tell
whether they are still going.
"""
from __future__ import annotations

import time

import mlflow

from rlhf_mlflow.core.process import process_state
from rlhf_mlflow.tracking import registry as REG
from rlhf_mlflow.tracking.release_lock import SUFFIX, break_lock, stale_reason


def repair(dry_run: bool = False) -> list[str]:
    """What was (or, with dry_run, would be) done, one line each."""
    return _runs(dry_run) + _locks(dry_run) + _releases(dry_run)


def _runs(dry_run: bool) -> list[str]:
    client = mlflow.MlflowClient()
    out = []
    for run in mlflow.search_runs(search_all_experiments=True, filter_string="attributes.status = 'RUNNING'",
                                  output_format="list"):
        tags, rid = run.data.tags, run.info.run_id
        what = f"run {rid} ({tags.get('rlhf.step', '?')} {run.info.run_name})"
        state = process_state(tags)
        if state == "gone":
            if not dry_run:
                client.set_tag(rid, "rlhf.repaired", f"process {tags['rlhf.pid']} gone; marked FAILED at "
                                                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
                client.set_terminated(rid, "FAILED")
            out.append(f"{what}: its process {tags['rlhf.pid']} is gone -> FAILED"
                       + ("; continue it with `rlhf-mlflow train-rl --resume " + rid + "`"
                          if tags.get("rlhf.step") == "train_rl" else ""))
        elif state == "unknown":
            where = f"on host {tags['rlhf.host']}" if "rlhf.host" in tags else "with no process tags"
            out.append(f"{what}: RUNNING {where}; left alone")
    return out


def _locks(dry_run: bool) -> list[str]:
    out = []
    for model in mlflow.MlflowClient().search_registered_models():
        if not model.name.endswith(SUFFIX):
            continue
        tags = dict(model.tags)
        why = stale_reason(tags)
        if why is None:
            out.append(f"release lock {model.name}: held by run {tags.get('run_id')} (still valid); left alone")
        elif dry_run or break_lock(model.name, tags, why):
            out.append(f"release lock {model.name}: removed ({why})")
    return out


def _releases(dry_run: bool) -> list[str]:
    out = []
    champion = REG.champion_version()
    for name in {m.name for m in mlflow.MlflowClient().search_registered_models() if not m.name.endswith(SUFFIX)}:
        for mv in REG.client().search_model_versions(f"name = '{name}'"):
            if mv.tags.get("release.decision") != "promoting":
                continue
            held = name == REG.REGISTERED_MODEL and champion is not None and champion.version == mv.version
            decision = "promoted" if held else "interrupted"
            if not dry_run:
                REG.set_tags(mv.version, {"release.decision": decision}, name)
            out.append(f"{name} version {mv.version}: release was cut short -> release.decision={decision}")
    return out
