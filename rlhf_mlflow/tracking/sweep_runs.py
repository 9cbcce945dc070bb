"""The MLflow side of a recipe sweep: one parent run per sweep, one child run per trial.

A trial's child run is its train_rl run (params, per-family curves, checkpoints, a registered
version of `rlhf-policy`), tagged with the sweep's parent run id; after training the same run gets
the trial's dev evaluation (`dev_<metric>/<family>`) and every release guardrail (`guardrail/<name>` = 1
or 0, the reasons in tags); its certification is a certify run nested under it, which tags the
version as `rlhf-mlflow certify` does, so `rlhf-mlflow release --model-version V` can act on the
sweep's best trial as is.

`run_trial` runs inside a Ray worker: everything it needs travels in a picklable TrialContext.
"""
from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import mlflow

from . import runs as T

log = logging.getLogger(__name__)
DEV_PREFIX = "dev_"


@dataclass(frozen=True)
class TrialContext:
    tracking_uri: str
    """Where every trial logs (absolute: trials run in other processes, maybe on other machines)."""
    experiment_name: str
    parent_run_id: str
    """The sweep's parent run; each trial's run is tagged as its child."""
    world_dir: str
    """Fixture directory: dev prompts, expert gold set, reference policy, reward model."""
    base: dict
    """The resolved RLConfig (as a dict) that each trial's recipe overrides."""
    threads: int = 1
    """torch threads per trial."""
    register: bool = True
    diagnostic: dict | None = None
    """Gold-free diagnostic evidence; certify counts its flagged shortcuts (marker-collapse guardrail)."""
    champion: dict | None = None
    """The current champion's certification report (beats-champion guardrail), or None."""
    guardrails: dict = field(default_factory=dict)
    """GuardrailConfig overrides."""


def absolute_tracking_uri() -> str:
    """The active tracking URI with a relative sqlite or file path made absolute."""
    uri = mlflow.get_tracking_uri()
    for prefix in ("sqlite:///", "file://"):
        if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
            return prefix + os.path.abspath(uri[len(prefix):])
    if "://" not in uri:
        return os.path.abspath(uri)
    return uri


def is_local_store(uri: str) -> bool:
    return uri.startswith(("sqlite:", "file:", "/")) or "://" not in uri


@contextmanager
def sweep_run(name: str, params: dict) -> Iterator[tuple[mlflow.ActiveRun, str]]:
    """The sweep's parent run; yields (run, experiment name)."""
    with T.tracked_run("sweep", params, run_name=name) as run:
        yield run, mlflow.get_experiment(run.info.experiment_id).name


def log_training_inputs(prompt_files: set[str]) -> None:
    """Log each training prompt file on the parent before any trial starts. MLflow inserts a dataset
    row the first time a run of the experiment logs it, without a lock: trials logging the same new
    file at once collide on its unique key (seen on sqlite), while one that exists is only linked."""
    from ..data import read_jsonl
    for path in sorted(prompt_files):
        T.log_records_input(read_jsonl(path), path, "training")


def current_champion() -> dict | None:
    """The certification report of the version `champion` points at, if any."""
    from . import registry as REG
    mv = REG.champion_version()
    return None if mv is None else REG.champion_certification(mv)


def enter_worker(tracking_uri: str, experiment_name: str, threads: int) -> None:
    """Point this worker process (a Ray trial, a `main` trainer) at a store and experiment, never at a
    launcher's run (`mlflow run` exports MLFLOW_RUN_ID), with `threads` torch threads."""
    from ..runtime import configure_threads, handle_signals
    handle_signals()
    os.environ.pop("MLFLOW_RUN_ID", None)
    os.environ.pop("MLFLOW_EXPERIMENT_ID", None)
    os.environ["MLFLOW_TRACKING_URI"] = tracking_uri
    os.environ["MLFLOW_EXPERIMENT_NAME"] = experiment_name
    os.environ["RLHF_THREADS"] = str(threads)
    mlflow.set_tracking_uri(tracking_uri)
    while mlflow.active_run():
        mlflow.end_run()
    configure_threads()


def _enter_worker(ctx: TrialContext) -> None:
    enter_worker(ctx.tracking_uri, ctx.experiment_name, ctx.threads)


def run_trial(ctx: TrialContext, recipe: dict) -> dict:
    """Train, evaluate, certify and check one recipe; returns its row of the sweep table."""
    from ..config import from_dict
    from ..rl_run import run_train_rl
    from ..sweep import trial_name
    from ..train_rl import RLConfig
    _enter_worker(ctx)
    cfg = from_dict(RLConfig, {**ctx.base, **recipe}, f"trial {recipe}")
    name = trial_name(recipe)
    tags = {"mlflow.parentRunId": ctx.parent_run_id, "rlhf.sweep_run": ctx.parent_run_id, "rlhf.trial": name}
    with tempfile.TemporaryDirectory() as tmp:
        policy_dir = os.path.join(tmp, "policy")
        summary = run_train_rl(cfg, world_dir=ctx.world_dir, out=policy_dir, run_name=name, register=ctx.register,
                               echo=log.info, progress=False, tags=tags)
        with resumed_run(summary["run_id"]):
            dev = evaluate_trial(policy_dir, cfg, ctx)
            T.log_metrics({DEV_PREFIX + k: v for k, v in dev.items()})
            report, gates = certify_trial(policy_dir, cfg, ctx, summary.get("model_version"))
    row = {"run_id": summary["run_id"], "model_version": summary.get("model_version"),
           "seconds": summary["seconds"], "proxy/balanced": summary.get("proxy/balanced"),
           "kl/balanced": summary.get("kl/balanced"),
           **{DEV_PREFIX + k: dev[k] for k in ("proxy/balanced", "kl/balanced", "proxy/pilot") if k in dev}}
    row.update(_certified_columns(report))
    row.update({f"guardrail/{k}": bool(ok) for k, (ok, _) in gates.items()})
    row["failed_guardrails"] = "; ".join(f"{k}: {why}" for k, (ok, why) in gates.items() if not ok)
    return row


@contextmanager
def resumed_run(run_id: str) -> Iterator[mlflow.ActiveRun]:
    """Reopen a finished run to add to it; FAILED (and re-raised) if the body raises."""
    run = mlflow.start_run(run_id=run_id)
    try:
        yield run
    except BaseException:
        mlflow.end_run(status="FAILED")
        raise
    mlflow.end_run(status="FINISHED")


def evaluate_trial(policy_dir: str, cfg, ctx: TrialContext) -> dict[str, float]:
    """The seed's dev evaluation of the trial's policy on the world's dev prompts."""
    from .. import data as D
    from .. import model as M
    from .. import reward_model as R
    from ..evaluate import dev_eval
    world = ctx.world_dir
    res = dev_eval(M.load_policy(policy_dir)[0], M.load_policy(cfg.policy_ref)[0], R.load_rm(cfg.reward_model)[0],
                   D.read_jsonl(os.path.join(world, "data", "prompts_dev.jsonl")),
                   D.read_jsonl(os.path.join(world, "data", "gold_calib.jsonl"), labelled=True))
    return res.metrics


def certify_trial(policy_dir: str, cfg, ctx: TrialContext, version: str | None
                  ) -> tuple[dict | None, dict[str, tuple[bool, str]]]:
    """Certify the trial's policy (a certify run, child of the trial's run, that tags the version as
    `rlhf-mlflow certify` does, so release can act on it), then evaluate every release guardrail on
    the trial's run. Returns (report, {guardrail: (passed, reason)})."""
    from .. import guardrails as G
    from ..release_run import run_certify
    world = ctx.world_dir
    res = run_certify(version=version, policy=None if version else policy_dir, reference=cfg.policy_ref,
                      gold=os.path.join(world, "data", "gold_calib.jsonl"), rm_dir=cfg.reward_model,
                      correction=cfg.reward_wrapper, diagnostic=ctx.diagnostic,
                      pilot_prompts=os.path.join(world, "data", "prompts_dev.jsonl"), echo=log.info,
                      tags={"rlhf.sweep_run": ctx.parent_run_id})
    report = res["report"]
    gates = G.evaluate(report, G.GuardrailConfig.from_dict(dict(ctx.guardrails)), ctx.champion)
    T.log_metrics({f"guardrail/{k}": float(ok) for k, (ok, _) in gates.items()})
    T.log_json_artifact({k: {"pass": ok, "reason": why} for k, (ok, why) in gates.items()}, "guardrails.json")
    mlflow.set_tags({"rlhf.certification_run": res["run_id"],
                     **{f"guardrail.{k}": f"{'pass' if ok else 'fail'}: {why}"[:4900] for k, (ok, why) in gates.items()}})
    return report, gates


def _certified_columns(report: dict | None) -> dict:
    if report is None:
        return {"certified/balanced": None}
    b = report["balanced"]
    return {"certified/balanced": b.get("estimate"), "certified_lo/balanced": b.get("lo"),
            "certified_hi/balanced": b.get("hi"), "gain/balanced": b.get("gain"),
            "reference_quality/balanced": b.get("reference")}


def log_sweep_results(table, best) -> None:
    """The trial table (CSV and an MLflow table) on the parent run; the best trial in its tags."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trials.csv")
        table.to_csv(path, index=False)
        T.log_artifact(path, "sweep")
    mlflow.log_table(table.astype(object).where(table.notna(), None), "sweep/trials.json")
    if best is None:
        mlflow.set_tag("rlhf.best_trial", "none: no trial passed every guardrail")
        return
    mlflow.set_tags({"rlhf.best_trial": best["trial"], "rlhf.best_run_id": best["run_id"],
                     "rlhf.best_model_version": str(best.get("model_version"))})
    T.log_metrics({"best_certified/balanced": float(best["certified/balanced"])})
